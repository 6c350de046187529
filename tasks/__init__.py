"""Flyte tasks: thin adapters from typed task interfaces to the engine (`rlhf`)."""

from tasks.literal_types import install as _install_literal_types

_install_literal_types()
