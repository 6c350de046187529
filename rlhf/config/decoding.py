"""The hooks flytekit decodes a `PPOConfig` input with, held to the config's keys.

flytekit builds a dataclass input with dataclasses_json (`pyflyte run ... --cfg FILE|JSON`
calls the class's `from_json`) or mashumaro (a task decoding its input calls the class's
`__pre_deserialize__`); both drop keys they do not know. `install` gives the config class
both hooks, which translate verl's keys and check the rest first (`rlhf.config.keys`), so
a misspelled key stops the launch.

`rlhf.config` calls `install` when the package is imported, which importing any of its
modules does first; the config classes themselves (`rlhf.config.schema`) import nothing.
"""

from __future__ import annotations

from rlhf.config.keys import from_json_checked, pre_deserialize_checked
from rlhf.config.schema import PPOConfig


def install(cls: type = PPOConfig) -> None:
    """Give `cls` flytekit's decoding hooks: `cls.from_json(text)`, the config `pyflyte run ...
    --cfg FILE|JSON` builds (unknown keys raise `ConfigError`; the values convert as
    flytekit's own dataclasses_json decoding converts them), and `cls.__pre_deserialize__(d)`,
    mashumaro's hook when a task decodes a config input (the same key check, for a config
    launched from outside Python: console, flytectl)."""
    cls.from_json = classmethod(from_json_checked)
    cls.__pre_deserialize__ = classmethod(pre_deserialize_checked)
