"""Flyte tasks: thin adapters from typed task interfaces to the engine (`rlhf`)."""

from rlhf.config.doc import describe_fields as _describe_fields
from tasks.literal_types import install as _install_literal_types

# The config fields get their descriptions before any literal type is built and kept: a
# literal type memoized earlier would carry a config input schema without them.
_describe_fields()
_install_literal_types()
