"""verl 0.9.1's rollout-correction value syntax (`verl/trainer/ppo/rollout_corr_helper.py`):
the rejection criteria and the threshold strings, parsed as verl parses them (a ValueError
where verl raises). Plain Python with no imports from this project, so that the tensor math
(`rlhf.algos.correction`, `rlhf.algos.rejection`) and the load-time check
(`rlhf.config.correction`) share one parser.

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

from typing import Optional, Union

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
