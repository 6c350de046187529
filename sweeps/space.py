"""The search space as data, and the pure step from sampled values to config overrides.

Defaults tune the three knobs that decide whether KL-regularized PPO converges:
`algorithm.kl_ctrl.kl_coef` (log-uniform 1e-4..1e-1), `actor.clip_ratio` (0.1..0.3) and
`actor.entropy_coeff` (0..0.01). Any other config key may be added as a `ParamSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.config.load import replace
from rlhf.config.schema import PPOConfig, all_keys


@dataclass(frozen=True)
class ParamSpec:
    name: str  # dotted PPOConfig key, e.g. "actor.clip_ratio"
    low: float = 0.0
    high: float = 1.0
    log: bool = False  # sample log-uniformly
    kind: str = "float"  # "float" | "int" | "categorical"
    choices: list[str] = field(default_factory=list)  # for "categorical" (YAML-parsed when applied)


DEFAULT_SPACE: tuple[ParamSpec, ...] = (
    ParamSpec("algorithm.kl_ctrl.kl_coef", 1e-4, 1e-1, log=True),
    ParamSpec("actor.clip_ratio", 0.1, 0.3),
    ParamSpec("actor.entropy_coeff", 0.0, 0.01),
)


def default_space() -> list[ParamSpec]:
    return list(DEFAULT_SPACE)


def check_space(space: list[ParamSpec]) -> None:
    """Every name is a config key, bounds are ordered, log ranges are positive."""
    keys = set(all_keys())
    seen = set()
    for p in space:
        if p.name not in keys:
            raise ValueError(f"sweep parameter '{p.name}' is not a config key")
        if p.name in seen:
            raise ValueError(f"sweep parameter '{p.name}' appears twice")
        seen.add(p.name)
        if p.kind == "categorical":
            if not p.choices:
                raise ValueError(f"sweep parameter '{p.name}' is categorical but has no choices")
        elif p.kind in ("float", "int"):
            if not p.low <= p.high:
                raise ValueError(f"sweep parameter '{p.name}': low {p.low} > high {p.high}")
            if p.log and p.low <= 0:
                raise ValueError(f"sweep parameter '{p.name}': a log range needs low > 0, got {p.low}")
        else:
            raise ValueError(f"sweep parameter '{p.name}': kind must be float, int or categorical, got {p.kind!r}")


def suggest(trial: Any, space: list[ParamSpec]) -> dict[str, Any]:
    """Sample one point from an Optuna trial (ask interface)."""
    out: dict[str, Any] = {}
    for p in space:
        if p.kind == "float":
            out[p.name] = trial.suggest_float(p.name, p.low, p.high, log=p.log)
        elif p.kind == "int":
            out[p.name] = trial.suggest_int(p.name, int(p.low), int(p.high), log=p.log)
        else:
            out[p.name] = trial.suggest_categorical(p.name, list(p.choices))
    return out


def to_overrides(params: dict[str, Any]) -> list[str]:
    """{"actor.clip_ratio": 0.25} -> ["actor.clip_ratio=0.25"] (repr keeps floats exact)."""
    return [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(params.items())]


def apply(cfg: PPOConfig, params: dict[str, Any]) -> PPOConfig:
    """A new config with the trial's values; the base config is not changed."""
    return replace(cfg, to_overrides(params))
