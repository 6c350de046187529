"""Convergence metrics of one trial, and the objectives a sweep maximizes.

All pure functions of a trial's history (the `RoundState` the pipeline returns):
best and final val score, the area under the val curve, the KL budget (fraction of
PPO steps whose KL to the reference exceeded `target_kl`), steps and rounds to reach
a score, and the stop reason.

Objectives (`SweepConfig.objective`, all higher-is-better, then the same penalties):
- `final_val`: the last val score.
- `auc`: the area under the val curve over rounds 1..R, divided by R (R = the trial's
  `trainer.total_rounds`): the mean val score over the run, so a config that gets
  there sooner scores higher. Each round takes the latest score measured by then
  (rounds after an early stop keep the last one; rounds before the first, the round-0
  score or 0).
- `rounds_to_target`: (R - r + 1) / R when round r was the first to reach
  `score_threshold` (1 at round 1), 0 when no round did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Stop reasons (from rlhf.round.state.decide) that mean the run diverged rather than converged.
DIVERGENCE_MARKERS = ("above the ceiling", "above target_kl", "non-finite")


@dataclass(frozen=True)
class TrialMetrics:
    best_val: float
    final_val: float
    start_val: float
    kl_budget: float  # fraction of steps with KL > target_kl, in [0, 1]
    mean_kl: float
    steps_to_score: int  # first global step whose val score reached `score_threshold`; -1 => never
    stop_reason: str
    diverged: bool
    steps: int
    auc_val: float = 0.0  # mean val score over rounds 1..max_rounds (see the module docstring)
    rounds_to_score: int = -1  # first round whose val score reached `score_threshold`; -1 => never
    last_val_round: int = 0  # the last round with a val score
    max_rounds: int = 0  # rounds it could have run (trainer.total_rounds)


def val_curve(val_history: list[dict[str, float]], max_rounds: int) -> list[float]:
    """The val score after each round 1..max_rounds as a step function: a round without
    a measurement (test_freq > 1, or after an early stop) keeps the latest score."""
    by_round = {int(v["round"]): float(v["score"]) for v in val_history}
    latest, curve = by_round.get(0, 0.0), []
    for r in range(1, max_rounds + 1):
        latest = by_round.get(r, latest)
        curve.append(latest)
    return curve


def convergence_metrics(step_history: list[dict[str, float]], val_history: list[dict[str, float]],
                        stop_reason: str, target_kl: float, score_threshold: float, max_rounds: int = 0
                        ) -> TrialMetrics:
    """`max_rounds` (trainer.total_rounds) spans the val curve; 0 => the last round measured."""
    kls = [h.get("actor/current_kl", 0.0) for h in step_history]
    vals = [v["score"] for v in val_history]
    reached = [int(v["step"]) for v in val_history if v["score"] >= score_threshold]
    rounds_reached = [int(v["round"]) for v in val_history if v["score"] >= score_threshold and v["round"] >= 1]
    last = max((int(v["round"]) for v in val_history), default=0)
    span = max_rounds or last
    curve = val_curve(val_history, span)
    return TrialMetrics(
        best_val=max(vals) if vals else 0.0,
        final_val=vals[-1] if vals else 0.0,
        start_val=vals[0] if vals else 0.0,
        kl_budget=sum(k > target_kl for k in kls) / len(kls) if kls else 0.0,
        mean_kl=sum(kls) / len(kls) if kls else 0.0,
        steps_to_score=reached[0] if reached else -1,
        stop_reason=stop_reason,
        diverged=any(m in stop_reason for m in DIVERGENCE_MARKERS),
        steps=len(step_history),
        auc_val=sum(curve) / len(curve) if curve else 0.0,
        rounds_to_score=rounds_reached[0] if rounds_reached else -1,
        last_val_round=last,
        max_rounds=span,
    )


def _speed(m: TrialMetrics) -> float:
    if m.rounds_to_score < 1 or m.max_rounds < 1:
        return 0.0
    return (m.max_rounds - m.rounds_to_score + 1) / m.max_rounds


# Objective name -> the score it takes from a trial's metrics (before the penalties).
OBJECTIVES: dict[str, Callable[[TrialMetrics], float]] = {
    "final_val": lambda m: m.final_val,
    "auc": lambda m: m.auc_val,
    "rounds_to_target": _speed,
}


def check_objective(name: str) -> None:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown sweep objective {name!r}; choose one of {sorted(OBJECTIVES)}")


def objective(m: TrialMetrics, kl_budget_weight: float = 0.5, divergence_penalty: float = 0.25,
              name: str = "final_val") -> float:
    """The named objective's score (`OBJECTIVES`), minus `kl_budget_weight` x the KL-budget
    violation fraction, minus `divergence_penalty` when the run stopped because it diverged.
    Higher is better."""
    check_objective(name)
    return OBJECTIVES[name](m) - kl_budget_weight * m.kl_budget - (divergence_penalty if m.diverged else 0.0)


def pareto_objectives(m: TrialMetrics) -> tuple[float, float]:
    """Two-objective mode: (final val score, to maximize; mean KL, to minimize)."""
    return m.final_val, m.mean_kl


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points not dominated under (maximize first, minimize second)."""
    front = []
    for i, (s, k) in enumerate(points):
        dominated = any((s2 >= s and k2 <= k) and (s2 > s or k2 < k) for j, (s2, k2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front
