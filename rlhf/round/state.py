"""State that crosses rounds, and the early-stopping decision over it.

`RoundState` is saved in every checkpoint (so a resumed run keeps the adaptive KL
coefficient, the data cursor and the stopping counters) and is the typed value
that the Flyte workflow passes from one round to the next.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from rlhf.config.schema import PPOConfig

# Metrics kept in the state's history (the full set goes to the tracker).
HISTORY_KEYS = (
    "critic/score/mean", "actor/current_kl", "actor/reward_kl_penalty_coeff", "actor/pg_loss",
    "critic/vf_loss", "actor/entropy", "actor/pg_clipfrac", "response_length/mean", "actor/grad_norm",
)


@dataclass
class RoundState:
    round: int = 0  # rounds completed
    global_step: int = 0  # PPO steps completed
    kl_coef: float = 0.0  # the KL controller's current value
    best_val: float = -1.0  # best validation score so far (-1 => none yet)
    val_start: float = -1.0  # validation score before training (-1 => not measured)
    last_val: float = -1.0
    epoch: int = 0  # prompt sampler position
    cursor: int = 0
    consecutive_kl_over: int = 0
    evals_without_improvement: int = 0
    skipped_steps: int = 0
    stop_reason: str = ""
    step_history: list[dict[str, float]] = field(default_factory=list)
    val_history: list[dict[str, float]] = field(default_factory=list)  # {"round", "step", "score"}
    # Tracking across the tasks of one Flyte execution: the wandb run every task resumes, and
    # MLflow records a task could not send (server down), replayed by the next task's sink.
    wandb_id: str = ""
    tracking_pending: list[str] = field(default_factory=list)  # JSON records of BufferedMLflowSink
    checkpoints: list[str] = field(default_factory=list)  # URIs of the Flyte tasks' checkpoints, newest last

    def __repr__(self) -> str:
        """One line (the histories as counts), so that a printed workflow output stays short."""
        return (f"RoundState(round={self.round}, global_step={self.global_step}, kl_coef={self.kl_coef:.5g}, "
                f"val_start={self.val_start:.4f}, last_val={self.last_val:.4f}, best_val={self.best_val:.4f}, "
                f"stop_reason={self.stop_reason!r}, skipped_steps={self.skipped_steps}, "
                f"step_history=<{len(self.step_history)} steps>, val_history=<{len(self.val_history)} evaluations>)")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RoundState":
        return cls(**json.loads(text))

    @classmethod
    def initial(cls, cfg: PPOConfig) -> "RoundState":
        return cls(kl_coef=cfg.algorithm.kl_ctrl.kl_coef)


@dataclass(frozen=True)
class Verdict:
    stop: bool
    reason: str = ""


def record_steps(state: RoundState, step_metrics: list[dict[str, float]]) -> RoundState:
    hist = list(state.step_history)
    for i, m in enumerate(step_metrics):
        row = {k: float(m[k]) for k in HISTORY_KEYS if k in m}
        row["step"] = float(state.global_step + i + 1)
        hist.append(row)
    return RoundState(**{**asdict(state), "step_history": hist, "global_step": state.global_step + len(step_metrics)})


def record_val(state: RoundState, score: float, min_delta: float) -> RoundState:
    improved = score > state.best_val + min_delta or state.best_val < 0
    hist = list(state.val_history) + [{"round": float(state.round), "step": float(state.global_step),
                                       "score": float(score)}]
    return RoundState(**{
        **asdict(state),
        "val_history": hist,
        "last_val": score,
        "val_start": score if state.val_start < 0 and state.global_step == 0 else state.val_start,
        "best_val": max(score, state.best_val),
        "evals_without_improvement": 0 if improved else state.evals_without_improvement + 1,
    })


def decide(state: RoundState, step_metrics: list[dict[str, float]], cfg: PPOConfig) -> tuple[RoundState, Verdict]:
    """Early-stopping verdict after a round. Rules (all thresholds in `early_stop.*`):
    KL above `target_kl` for `kl_patience` consecutive steps; KL above `kl_ceiling` once;
    `val_patience` evaluations without improvement; `max_nonfinite_steps` skipped steps;
    a non-finite KL in a step that was applied."""
    es, target = cfg.early_stop, cfg.algorithm.kl_ctrl.target_kl
    over = state.consecutive_kl_over
    reason = ""
    for m in step_metrics:
        kl = m.get("actor/current_kl", 0.0)
        if not math.isfinite(kl):
            if not m.get("training/step_skipped"):  # a skipped step is counted below instead
                reason = reason or "non-finite KL between policy and reference"
            continue
        over = over + 1 if kl > target else 0
        if kl > es.kl_ceiling:
            reason = reason or f"KL {kl:.4f} above the ceiling early_stop.kl_ceiling={es.kl_ceiling}"
        if over >= es.kl_patience:
            reason = reason or f"KL above target_kl={target} for {over} consecutive steps"
    skipped = int(step_metrics[-1].get("training/skipped_steps", state.skipped_steps)) if step_metrics else \
        state.skipped_steps
    if skipped >= es.max_nonfinite_steps:
        reason = reason or f"{skipped} steps skipped for non-finite loss or gradients"
    if es.val_patience and state.evals_without_improvement >= es.val_patience:
        reason = reason or f"validation score did not improve for {state.evals_without_improvement} evaluations"
    if not es.enable:
        reason = ""
    new = RoundState(**{**asdict(state), "consecutive_kl_over": over, "skipped_steps": skipped,
                        "stop_reason": reason})
    return new, Verdict(stop=bool(reason), reason=reason)
