"""Flyte tasks: thin adapters from typed task interfaces to the engine (`rlhf`)."""

from rlhf.config.doc import describe_fields as _describe_fields
from tasks.literal_types import install as _install_literal_types

# Before any task's interface is built and its literal type kept: each config key's meaning (its
# comment, as in docs/CONFIG.md) goes into the config input's schema, which the Flyte console shows.
_describe_fields()
_install_literal_types()
