"""The one configuration tree, `PPOConfig`: its keys, how it is read, checked and sized.

Field names follow verl's dotted keys (`actor.clip_ratio`, `algorithm.kl_ctrl.kl_coef`,
...) so a verl config carries over. The tree is frozen: it is parsed once, from a
YAML/JSON file plus dotted `key=value` overrides, and never mutated afterwards.
Unknown keys raise with the closest valid name. `derive_sizes` is the one function
that turns batch settings into per-GPU sizes and checks that they divide.

- `schema`: `ConfigError`, the section dataclasses and `PPOConfig`, the accepted choices,
  the dotted key names, `to_dict` and `flatten`.
- `decoding`: the hooks flytekit decodes a config input with (this package installs them
  on `PPOConfig`).
- `keys`: the unknown-key check of configs decoded outside `load_config`.
- `verl_keys`: verl's own key names mapped onto this tree.
- `load`: `load_config`, `from_dict`, `replace`, `save_config`, `parse_override`.
- `checks`: `validate` and `GROUP_ESTIMATORS`.
- `correction`: verl's rollout-correction presets and `correction_settings`, the correction
  a config puts in effect; `correction_spec` parses its criteria and threshold strings.
- `ranges`: the valid range of every numeric key (checked by `load` beside `checks`).
- `sizes`: `derive_sizes`, `Sizes`, `rounds_for_epochs`, `resolve_epochs`.
- `redact`: credentials kept out of what a run stores and prints.
- `comments`: the comment beside each dataclass field, and the dotted-key table.
- `doc`: docs/CONFIG.md, rendered from the dataclasses.
- `registry`: a small name -> object registry.

This is the lowest layer of `rlhf`: its modules import only each other, the standard
library and yaml (dataclasses_json and click only inside the functions that decode a
flytekit input). The names below are re-exported for `from rlhf.config import ...`;
the submodules import each other directly, never this package.
"""

from rlhf.config import decoding as _decoding
from rlhf.config.checks import GROUP_ESTIMATORS, validate
from rlhf.config.correction import ROLLOUT_CORRECTION_PRESETS, correction_settings
from rlhf.config.load import from_dict, load_config, parse_override, replace, save_config
from rlhf.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ConfigError,
    CriticConfig,
    DataConfig,
    DeepSpeedConfig,
    EarlyStopConfig,
    KLCtrlConfig,
    ModelConfig,
    PPOConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    SFTConfig,
    SyntheticDataConfig,
    TinyModelConfig,
    TrainerConfig,
    all_keys,
    flatten,
    to_dict,
)
from rlhf.config.sizes import Sizes, derive_sizes, resolve_epochs, rounds_for_epochs

_decoding.install(PPOConfig)

__all__ = [
    "ActorConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig", "DeepSpeedConfig",
    "EarlyStopConfig", "GROUP_ESTIMATORS", "KLCtrlConfig", "ModelConfig", "PPOConfig", "ROLLOUT_CORRECTION_PRESETS",
    "RefConfig", "RewardConfig", "RolloutConfig", "RolloutCorrectionConfig", "SFTConfig", "Sizes",
    "SyntheticDataConfig", "TinyModelConfig", "TrainerConfig", "all_keys", "correction_settings", "derive_sizes",
    "flatten", "from_dict", "load_config", "parse_override", "replace", "resolve_epochs", "rounds_for_epochs",
    "save_config", "to_dict", "validate",
]
