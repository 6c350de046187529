"""The hooks flytekit decodes a `PPOConfig` input with, held to the config's keys.

flytekit builds a dataclass input with dataclasses_json (`pyflyte run ... --cfg FILE|JSON`
calls the class's `from_json`) or mashumaro (a task decoding its input calls the class's
`__pre_deserialize__`); both drop keys they do not know. `PPOConfig` inherits
`ConfigDecoding`, whose hooks translate verl's keys and check the rest
(`rlhf.config.verl_keys`, `rlhf.config.keys`) first, so a misspelled key stops the launch.
The checks are imported when a hook runs: they are built from the config tree, which
inherits this class.
"""

from __future__ import annotations


class ConfigDecoding:
    """flytekit's decoding hooks for a config dataclass; no fields of its own."""

    @classmethod
    def from_json(cls, text: str):
        """The config `pyflyte run ... --cfg FILE|JSON` builds (flytekit's click type for a
        dataclass input calls `from_json` with the parsed file). Unknown keys raise
        `ConfigError`; the values convert exactly as flytekit's own dataclass decoding
        (dataclasses_json, which keeps unknown keys out silently) converts them."""
        from rlhf.config.keys import from_json_checked

        return from_json_checked(cls, text)

    @classmethod
    def __pre_deserialize__(cls, d: dict) -> dict:
        """mashumaro's hook, run when flytekit decodes a config input in a task: the same key
        check, for a config launched from outside Python (console, flytectl)."""
        from rlhf.config.keys import check_keys
        from rlhf.config.verl_keys import translate_tree

        d = translate_tree(d)
        check_keys(d, "cfg input")
        return d
