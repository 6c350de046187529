"""verl 0.9.1's rollout-correction settings (`algorithm.rollout_correction`): its presets and
the correction a config puts in effect.

`correction_settings` (run at every load, after `validate`, and by the trainer) applies a preset and refuses, with
the key's name, every value verl would refuse at its first step; the values' syntax is
parsed by `rlhf.config.correction_spec`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

from rlhf.config.correction_spec import (BYPASS_LOSS_TYPES, IS_LEVELS, parse_criteria, parse_is_threshold,
                                         parse_rs_thresholds)
from rlhf.config.schema import ConfigError, PPOConfig, RolloutCorrectionConfig

# verl's `RolloutCorrectionConfig` class defaults, which its factory methods start from.
_VERL_BASE: dict[str, Any] = dict(rollout_is="sequence", rollout_is_threshold="2.0", rollout_is_batch_normalize=False,
                                  rollout_rs=None, rollout_rs_threshold=None, bypass_mode=False, loss_type="ppo_clip")
_GEO, _K3 = dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"), dict(rollout_rs="seq_mean_k3",
                                                                                   rollout_rs_threshold="0.01")
_BYPASS, _PG = dict(bypass_mode=True, loss_type="ppo_clip"), dict(bypass_mode=True, loss_type="reinforce")
_TOKEN, _SEQ, _NO_IS = dict(rollout_is="token"), dict(rollout_is="sequence"), dict(rollout_is=None)
_ICEPOP = dict(rollout_is="token", rollout_is_threshold="0.5_5.0")
# `algorithm.rollout_correction.preset=<name>`: verl 0.9.1's `RolloutCorrectionConfig.<name>()`
# with its default arguments (verl offers them in Python only; the key is this project's).
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, Any]] = {name: {**_VERL_BASE, **kw} for name, kw in {
    "disabled": dict(_NO_IS),
    "decoupled_token_is": dict(_TOKEN),
    "decoupled_seq_is": dict(_SEQ),
    "decoupled_token_icepop": dict(_ICEPOP),
    "decoupled_seq_is_rs": dict(_SEQ, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": dict(_NO_IS, **_GEO),
    "decoupled_geo_rs_seq_tis": dict(_SEQ, **_GEO),
    "decoupled_geo_rs_token_tis": dict(_TOKEN, **_GEO),
    "decoupled_k3_rs": dict(_NO_IS, **_K3),
    "decoupled_k3_rs_seq_tis": dict(_SEQ, **_K3),
    "decoupled_k3_rs_token_tis": dict(_TOKEN, **_K3),
    "bypass_ppo_clip": dict(_NO_IS, **_BYPASS),
    "bypass_ppo_clip_geo_rs": dict(_NO_IS, **_GEO, **_BYPASS),
    "bypass_ppo_clip_k3_rs": dict(_NO_IS, **_K3, **_BYPASS),
    "bypass_pg_is": dict(_SEQ, **_PG),
    "bypass_pg_token_icepop": dict(_ICEPOP, **_PG),
    "bypass_pg_geo_rs": dict(_NO_IS, **_GEO, **_PG),
    "bypass_pg_geo_rs_seq_tis": dict(_SEQ, **_GEO, **_PG),
    "bypass_pg_geo_rs_token_tis": dict(_TOKEN, **_GEO, **_PG),
}.items()}
RENAMED_PRESETS = {"ppo_is_bypass": "bypass_ppo_clip"}


def correction_settings(cfg: PPOConfig) -> RolloutCorrectionConfig:
    """The rollout correction in effect: `algorithm.rollout_correction` with its `preset`
    applied, or token-level truncated IS at `actor.tis_imp_ratio_cap` when that is set. A
    preset or the cap together with changed fields raises (one source of truth per run),
    and so does every value verl would refuse, naming the key."""
    rc = cfg.algorithm.rollout_correction
    changed = {f.name for f in fields(rc) if f.name != "preset" and getattr(rc, f.name) != f.default}
    cap = cfg.actor.tis_imp_ratio_cap
    if cap != -1.0 and cap <= 0:
        raise ConfigError(f"actor.tis_imp_ratio_cap must be > 0, or -1 for off; got {cap}")
    if rc.preset:
        if rc.preset not in ROLLOUT_CORRECTION_PRESETS:
            hint = f" (verl 0.9.1 names it {RENAMED_PRESETS[rc.preset]})" if rc.preset in RENAMED_PRESETS else ""
            raise ConfigError(f"algorithm.rollout_correction.preset {rc.preset!r} is unknown{hint}; choose one of "
                              f"{', '.join(ROLLOUT_CORRECTION_PRESETS)}")
        if changed or cap > 0:
            raise ConfigError(f"algorithm.rollout_correction.preset={rc.preset} sets the correction; remove "
                              f"{', '.join(sorted(changed)) or 'actor.tis_imp_ratio_cap'} or the preset")
        rc = dataclasses.replace(rc, **ROLLOUT_CORRECTION_PRESETS[rc.preset])
    elif cap > 0:
        if changed:
            raise ConfigError(f"actor.tis_imp_ratio_cap is verl's older spelling of rollout_is=token with "
                              f"rollout_is_threshold=cap; remove it or algorithm.rollout_correction."
                              f"{', algorithm.rollout_correction.'.join(sorted(changed))}")
        rc = dataclasses.replace(rc, rollout_is="token", rollout_is_threshold=str(cap))
    _check(rc)
    return rc


def _check(rc: RolloutCorrectionConfig) -> None:
    key = "algorithm.rollout_correction"
    if rc.rollout_is is not None and rc.rollout_is not in IS_LEVELS:
        raise ConfigError(f"{key}.rollout_is is {rc.rollout_is!r}; choose token, sequence or null")
    if rc.loss_type not in BYPASS_LOSS_TYPES:
        raise ConfigError(f"{key}.loss_type is {rc.loss_type!r}; choose {' or '.join(BYPASS_LOSS_TYPES)}")
    try:
        if rc.rollout_is_threshold is not None:
            parse_is_threshold(rc.rollout_is_threshold)
    except ValueError as e:
        raise ConfigError(f"{key}.rollout_is_threshold: {e}. Give a number (the cap) or a quoted "
                          "'lower_upper' such as '0.5_5.0'") from None
    if rc.rollout_rs is None:
        return  # verl reads rollout_rs_threshold only with rollout_rs
    try:
        criteria = parse_criteria(rc.rollout_rs)
    except ValueError as e:
        raise ConfigError(f"{key}.rollout_rs: {e}") from None
    try:
        parse_rs_thresholds(criteria, rc.rollout_rs_threshold)
    except ValueError as e:
        raise ConfigError(f"{key}.rollout_rs_threshold: {e}") from None
