"""The confirm phase: the sweep's top trials and the default config re-run on fresh seeds,
and the decision which config the sweep recommends.

A sweep's trials each ran once on one seed, and the best of many noisy runs is biased
upward (the winner's curse). So the top `k` complete trials and the base config run again
on `seeds` (values of `trainer.seed` no trial used), for `rounds` rounds each, scored with
the sweep's objective. Per config: the mean and the standard error of the mean over seeds.
The winner is the candidate with the highest mean among those whose mean exceeds the
default's by more than `z` standard errors of the difference,
sqrt(se_candidate**2 + se_default**2); when none does, the default config stays.

Everything here is pure: plain values in, plain values out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

DEFAULT_LABEL = "default"


@dataclass(frozen=True)
class ConfirmSpec:
    k: int = 2  # top complete trials re-run besides the default config; 0 => no confirm phase
    seeds: list[int] = field(default_factory=lambda: [1001, 1002, 1003])  # fresh trainer.seed values
    rounds: int = 0  # PPO rounds per confirm run; 0 => trainer.total_rounds
    z: float = 2.0  # a candidate must beat the default's mean by more than z standard errors


@dataclass
class ConfirmRun:
    """One re-run: which config (label, trial number, -1 for the default), on which seed."""

    label: str = ""
    trial: int = -1
    seed: int = 0
    params: dict[str, str] = field(default_factory=dict)  # the swept values, as text


@dataclass
class ConfirmRow:
    """One config's re-runs: a score and a val curve per seed that finished."""

    label: str = ""
    trial: int = -1
    params: dict[str, str] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # the sweep's objective, one per seed
    final_vals: list[float] = field(default_factory=list)
    curves: list[list[float]] = field(default_factory=list)  # val score after each round, one per seed
    failed_seeds: list[int] = field(default_factory=list)
    mean: float = 0.0
    se: float = 0.0  # standard error of the mean; 0 with fewer than 2 scores (n says which)
    n: int = 0


@dataclass
class Confirmed:
    """The confirm table and its decision; `winner` is a row label ("" => no confirm phase)."""

    objective: str = ""
    rows: list[ConfirmRow] = field(default_factory=list)
    winner: str = ""
    winner_trial: int = -1
    reason: str = ""


def check_confirm(spec: ConfirmSpec, train_seed: int) -> None:
    """Counts are sane and the seeds are fresh (not the seed every trial ran on)."""
    if spec.k < 0 or spec.rounds < 0:
        raise ValueError(f"sweep.confirm.k ({spec.k}) and sweep.confirm.rounds ({spec.rounds}) must be >= 0")
    if spec.k and len(spec.seeds) < 2:
        raise ValueError(f"sweep.confirm.seeds needs at least 2 seeds for a standard error, got {spec.seeds}")
    if len(set(spec.seeds)) != len(spec.seeds):
        raise ValueError(f"sweep.confirm.seeds repeats a seed: {spec.seeds}")
    if spec.k and train_seed in spec.seeds:
        raise ValueError(f"sweep.confirm.seeds {spec.seeds} holds trainer.seed={train_seed}, the seed the "
                         "trials ran on; confirm on fresh seeds")
    if spec.z <= 0:
        raise ValueError(f"sweep.confirm.z must be > 0, got {spec.z}")


def mean_se(xs: list[float]) -> tuple[float, float]:
    """(mean, standard error of the mean = sample standard deviation / sqrt(n)); the
    standard error is 0 below 2 values (`n` tells it apart from a true 0)."""
    if not xs:
        return 0.0, 0.0
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, 0.0
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return mean, math.sqrt(var / len(xs))


def make_row(label: str, trial: int, params: dict[str, str], results: list[tuple[int, Optional[tuple]]]) -> ConfirmRow:
    """A row from (seed, (score, final val, curve) or None when the run failed) per seed."""
    done = [(s, r) for s, r in results if r is not None]
    scores = [r[0] for _, r in done]
    mean, se = mean_se(scores)
    return ConfirmRow(label=label, trial=trial, params=params, seeds=[s for s, _ in done], scores=scores,
                      final_vals=[r[1] for _, r in done], curves=[list(r[2]) for _, r in done],
                      failed_seeds=[s for s, r in results if r is None], mean=mean, se=se, n=len(scores))


def decide(rows: list[ConfirmRow], z: float = 2.0) -> tuple[Optional[ConfirmRow], str]:
    """(the winning row, why); None => keep the default config."""
    default = next((r for r in rows if r.trial < 0), None)
    candidates = sorted((r for r in rows if r.trial >= 0), key=lambda r: (-r.mean, r.trial))
    if default is None or default.n < 2:
        return None, (f"the default config finished {default.n if default else 0} confirm runs, fewer than 2: "
                      "no standard error to compare against; keeping the default config")
    passed, notes = [], []
    for c in candidates:
        if c.n < 2:
            notes.append(f"{c.label} finished {c.n} confirm runs (< 2)")
            continue
        diff, se = c.mean - default.mean, math.sqrt(c.se ** 2 + default.se ** 2)
        notes.append(f"{c.label}: {c.mean:.4f} - {default.mean:.4f} = {diff:+.4f} vs {z:g} x SE {se:.4f}")
        if diff > z * se:
            passed.append(c)
    if not candidates:
        return None, "no complete trial to confirm; keeping the default config"
    if not passed:
        return None, (f"no trial beats the default config by more than {z:g} standard errors "
                      f"({'; '.join(notes)}); keeping the default config")
    win = passed[0]
    return win, (f"{win.label} beats the default config by more than {z:g} standard errors over "
                 f"{win.n} fresh seeds ({'; '.join(notes)})")
