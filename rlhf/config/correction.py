"""verl 0.9.1's rollout-correction settings (`algorithm.rollout_correction`): the parsing of
its criteria and threshold strings, its presets, and the correction a config puts in effect.

`rlhf.algos.correction` and `rlhf.algos.rejection` compute with what is parsed here; the
load-time check (`correction_settings`, run by `validate`) refuses with the key's name
what verl would refuse at its first step. The semantics, from verl's
`trainer/ppo/rollout_corr_helper.py` and `trainer/config/algorithm.py`:

- `rollout_is_threshold`: a number (or a number in a string) is the truncation cap of the IS
  weights; a string "lower_upper" (e.g. '0.5_5.0') zeroes weights outside [lower, upper]
  (IcePop). Quote it: unquoted, YAML (and verl's Hydra) read 0.5_5 as the number 0.55.
- `rollout_rs`: criteria `token_k1|k2|k3`, `seq_sum_k1|k2|k3`, `seq_mean_k1|k2|k3`,
  `seq_max_k2|k3`, several joined by commas (all must pass).
- `rollout_rs_threshold`: one threshold for every criterion or one per criterion, joined
  by commas; for k1 criteria "lower_upper" bounds pi_rollout / pi_old (a single number u
  means lower 1/u), for k2/k3 a single upper bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any, Optional, Union

from rlhf.config.schema import ConfigError, PPOConfig, RolloutCorrectionConfig

Threshold = Union[str, float, int]
IS_LEVELS = ("token", "sequence")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
DIVERGENCES = ("k1", "k2", "k3")
RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
# verl's SUPPORTED_ROLLOUT_RS_OPTIONS: every level x divergence except seq_max_k1.
CRITERIA = tuple(f"{lv}_{k}" for lv in RS_LEVELS for k in DIVERGENCES if (lv, k) != ("seq_max", "k1"))
# this project's earlier spellings -> verl 0.9.1's criterion that decides the same way
RENAMED = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def parse_is_threshold(spec: Threshold) -> tuple[float, Optional[float]]:
    """(upper, lower or None) of `rollout_is_threshold`; ValueError where verl raises."""
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise ValueError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    if not text:
        raise ValueError("rollout_is_threshold must not be empty")
    lower_s, upper_s = text.split("_", 1) if isinstance(spec, str) and "_" in text else (None, text)
    try:
        upper = float(upper_s)
        lower = float(lower_s) if lower_s is not None else None
    except ValueError:
        raise ValueError(f"rollout_is_threshold {spec!r} is neither a number nor 'lower_upper'") from None
    if not upper > 0 or (lower is not None and not lower > 0):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout_is_threshold {spec!r}: the lower bound must be <= the upper bound")
    return upper, lower


def parse_criteria(rollout_rs: str) -> list[str]:
    """The criteria of a comma-separated `rollout_rs`, duplicates dropped, order kept."""
    if not isinstance(rollout_rs, str) or not rollout_rs.strip():
        raise ValueError("rollout_rs must be a non-empty string of criteria separated by commas")
    out: list[str] = []
    for name in (p.strip() for p in rollout_rs.split(",")):
        if not name:
            continue
        if name not in CRITERIA:
            hint = f" (verl 0.9.1 calls it {RENAMED[name]!r})" if name in RENAMED else ""
            raise ValueError(f"rollout_rs criterion {name!r} is unknown{hint}; choose from {', '.join(CRITERIA)}")
        if name not in out:
            out.append(name)
    return out


def parse_rs_thresholds(criteria: list[str], spec: Optional[Threshold]) -> dict[str, tuple[Optional[float], float]]:
    """criterion -> (lower, upper) from `rollout_rs_threshold`: ratio bounds for k1 (lower
    1/upper when only one number is given), an upper bound alone for k2/k3."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be given when rollout_rs is set (verl has no default)")
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise ValueError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
    parts = [p.strip() for p in spec.split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
    if len(parts) not in (1, len(criteria)):
        raise ValueError(f"rollout_rs_threshold gives {len(parts)} thresholds for {len(criteria)} criteria "
                         f"({', '.join(criteria)}); give one for all or one per criterion")
    parts = parts * len(criteria) if len(parts) == 1 else parts
    return {c: _rs_bounds(c, p) for c, p in zip(criteria, parts)}


def _rs_bounds(criterion: str, part: str) -> tuple[Optional[float], float]:
    k1 = criterion.endswith("k1")
    if "_" in part and not k1:
        raise ValueError(f"rollout_rs_threshold {part!r} for {criterion}: a k2/k3 criterion takes one upper "
                         "bound, not 'lower_upper'")
    lower_s, upper_s = part.split("_", 1) if "_" in part else (None, part)
    try:
        upper = float(upper_s)
        lower = float(lower_s) if lower_s is not None else (1.0 / upper if k1 else None)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"rollout_rs_threshold {part!r} for {criterion} is not a number"
                         + (" or 'lower_upper'" if k1 else "")) from None
    if not upper > 0 or (lower is not None and not lower > 0):
        raise ValueError(f"rollout_rs_threshold {part!r} for {criterion} must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout_rs_threshold {part!r} for {criterion} needs lower <= upper")
    return lower, upper


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
