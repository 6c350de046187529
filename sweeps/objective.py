"""Convergence metrics of one trial, and the objective a sweep maximizes.

All pure functions of a trial's history (the `RoundState` the pipeline returns):
best and final val score, the KL budget (fraction of PPO steps whose KL to the
reference exceeded `target_kl`), steps to reach a score, and the stop reason.
"""

from __future__ import annotations

from dataclasses import dataclass

# Stop reasons (from rlhf.state.decide) that mean the run diverged rather than converged.
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


def convergence_metrics(step_history: list[dict[str, float]], val_history: list[dict[str, float]],
                        stop_reason: str, target_kl: float, score_threshold: float) -> TrialMetrics:
    kls = [h.get("actor/current_kl", 0.0) for h in step_history]
    vals = [v["score"] for v in val_history]
    reached = [int(v["step"]) for v in val_history if v["score"] >= score_threshold]
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
    )


def objective(m: TrialMetrics, kl_budget_weight: float = 0.5, divergence_penalty: float = 0.25) -> float:
    """Final val score, minus `kl_budget_weight` x the KL-budget violation fraction, minus
    `divergence_penalty` when the run stopped because it diverged. Higher is better."""
    return m.final_val - kl_budget_weight * m.kl_budget - (divergence_penalty if m.diverged else 0.0)


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
