"""A trial as the PPO pipeline sees it: where to report its per-round val scores, and the
pruning check its `decide` step runs after every round.

Without a `TrialContext` the pipeline runs unchanged. With one, each round that measured a
val score reports it to the study (step = rounds done), and when the study's pruner says
so the run stops like any early stop, with a reason that starts with `PRUNED`; the sweep
then records the trial PRUNED. A context without a trial number (`number` < 0: the confirm
phase's re-runs, which are not trials of the study) reports nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rlhf.round.state import RoundState, Verdict
from rlhf.tracking.study import StudySpec, TrialReporter

PRUNED = "pruned"  # the stop reason of a pruned trial starts with this


@dataclass(frozen=True)
class TrialContext:
    """The study, its resolved storage URL and the trial's number: plain values, so a
    trial's tasks in other processes or pods reach the same study."""

    study: StudySpec = field(default_factory=StudySpec)
    storage: str = ""  # the resolved storage URL (`sweeps.study.storage_url`)
    number: int = -1  # the Optuna trial number; < 0 => a run outside the study (reports nothing)


def is_pruned(stop_reason: str) -> bool:
    return stop_reason.startswith(PRUNED)


def check_pruning(ctx: TrialContext, state: RoundState, verdict: Verdict, rounds_left: bool
                  ) -> tuple[RoundState, Verdict]:
    """Report the val score measured in this round to the study and stop the run when the
    pruner says so and rounds are left (a run that finished its rounds keeps its result).
    Scores of earlier rounds not reported yet (validations inside a colocated segment) are
    reported first, each at its round. An earlier stop reason wins; a round without a fresh
    val score reports nothing."""
    fresh = state.val_history[-1] if state.val_history else None
    if ctx.number < 0 or fresh is None or state.round == 0 or int(fresh["round"]) != state.round:
        return state, verdict
    with TrialReporter(ctx.storage, ctx.study, ctx.number) as reporter:
        done = reporter.reported_steps()
        for v in state.val_history[:-1]:
            r = int(v["round"])
            if r > 0 and r not in done:
                reporter.report(float(v["score"]), r)
        prune = reporter.report(float(fresh["score"]), state.round)
    if not prune or not rounds_left or verdict.stop:
        return state, verdict
    reason = (f"{PRUNED} by the sweep's {ctx.study.pruner} pruner after round {state.round} "
              f"(val score {fresh['score']:.4f})")
    return dataclasses.replace(state, stop_reason=reason), Verdict(stop=True, reason=reason)
