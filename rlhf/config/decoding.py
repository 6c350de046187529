"""The hooks flytekit decodes a `PPOConfig` input with, held to the config's keys.

flytekit builds a dataclass input with dataclasses_json (`pyflyte run ... --cfg FILE|JSON`
calls the class's `from_json`) or mashumaro (a task decoding its input calls the class's
`__pre_deserialize__`); both drop keys they do not know. `PPOConfig` inherits
`ConfigDecoding`, whose hooks translate verl's keys and check the rest first, so a
misspelled key stops the launch.

The checks (`rlhf.config.keys`, `rlhf.config.verl_keys`) are built from the config tree,
which inherits this class, so this module does not import them: `rlhf.config` installs
them (`install`) when the package is imported, which importing any of its modules does
first.
"""

from __future__ import annotations

from typing import Any, Callable

_HOOKS: dict[str, Callable[..., Any]] = {}


def install(from_json: Callable[[type, str], Any], pre_deserialize: Callable[[type, dict], dict]) -> None:
    """The functions the hooks call: `from_json(cls, text)` and `pre_deserialize(cls, data)`."""
    _HOOKS.update(from_json=from_json, pre_deserialize=pre_deserialize)


class ConfigDecoding:
    """flytekit's decoding hooks for a config dataclass; no fields of its own."""

    @classmethod
    def from_json(cls, text: str):
        """The config `pyflyte run ... --cfg FILE|JSON` builds (flytekit's click type for a
        dataclass input calls `from_json` with the parsed file). Unknown keys raise
        `ConfigError`; the values convert exactly as flytekit's own dataclass decoding
        (dataclasses_json, which keeps unknown keys out silently) converts them."""
        return _HOOKS["from_json"](cls, text)

    @classmethod
    def __pre_deserialize__(cls, d: dict) -> dict:
        """mashumaro's hook, run when flytekit decodes a config input in a task: the same key
        check, for a config launched from outside Python (console, flytectl)."""
        return _HOOKS["pre_deserialize"](cls, d)
