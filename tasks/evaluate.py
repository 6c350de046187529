"""Validation and the early-stop decision, with the training deck."""

from __future__ import annotations

from typing import NamedTuple, Optional

from flytekit import Deck, dynamic, task
from flytekit.types.directory import FlyteDirectory

from containers.images import CPU_IMAGE, GPU_IMAGE
from rlhf.train import stateless as P
from rlhf.train import report
from rlhf.train import setup as S
from rlhf.train.report import RoundClock
from rlhf.round import stages
from rlhf.config.schema import PPOConfig
from rlhf.tracking.plots import metrics_html, training_html
from rlhf.round.state import RoundState, decide as decide_stop
from rlhf.tracking.trial import TrialContext, check_pruning
from tasks.base import (CPU_SMALL, DECK, DECK_FIELDS, GPU, GPU_RETRIES, TRACKING_SECRETS, Prompts, gpu_resources,
                        launch_seconds, local_policy, retry_transient)

Evaluated = NamedTuple("Evaluated", [("state", RoundState), ("score", float)])
Decided = NamedTuple("Decided", [("state", RoundState), ("stop", bool), ("reason", str)])


@task(requests=gpu_resources(1), limits=gpu_resources(1), accelerator=GPU, interruptible=True,
      retries=GPU_RETRIES, container_image=GPU_IMAGE, enable_deck=True,
      deck_fields=DECK_FIELDS, secret_requests=TRACKING_SECRETS)
def evaluate(cfg: PPOConfig, policy: FlyteDirectory, val: Prompts, state: RoundState, run_id: str) -> Evaluated:
    """Greedy validation of `policy`; the score goes into the state (best, patience counter).
    Its deck lists the validation metrics; `decide`'s deck draws the curves. A run that a
    segment's own decision stopped before its last round is passed on as it is."""
    if state.stop_reason:
        return Evaluated(state=state, score=state.last_val)
    sink = S.tracking_sink(cfg, run_id, state)
    with retry_transient():
        new, metrics = P.evaluate_policy(cfg, local_policy(policy), val, state, sink)
    new = S.keep_pending(sink, new)
    Deck("validation", metrics_html(metrics, f"step {new.global_step}: val score {new.last_val:.4f} "
                                             f"(best {new.best_val:.4f}, start {new.val_start:.4f})"))
    return Evaluated(state=new, score=stages.val_score(metrics))


@task(requests=gpu_resources(1), limits=gpu_resources(1), accelerator=GPU, interruptible=True,
      retries=GPU_RETRIES, container_image=GPU_IMAGE)
def policy_score(cfg: PPOConfig, policy: FlyteDirectory, val: Prompts) -> float:
    """The val score of `policy` alone (no run state): for comparing two models on one val set."""
    with retry_transient():
        _, metrics = P.evaluate_policy(cfg, local_policy(policy), val, RoundState.initial(cfg))
    return stages.val_score(metrics)


@dynamic(requests=CPU_SMALL, container_image=CPU_IMAGE)
def score_policy(cfg: PPOConfig, policy: FlyteDirectory, val: Prompts) -> float:
    """`policy_score` on as many GPUs as the run's generation uses (vLLM's tensor parallel size)."""
    n = generation_gpus(cfg)
    return policy_score(cfg=cfg, policy=policy, val=val).with_overrides(requests=gpu_resources(n),
                                                                         limits=gpu_resources(n))


def generation_gpus(cfg: PPOConfig) -> int:
    """GPUs of a task that generates (rollout, validation): the engine's tensor parallel size."""
    return cfg.rollout.tensor_model_parallel_size


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, enable_deck=True,
      deck_fields=DECK_FIELDS)
def decide(cfg: PPOConfig, state: RoundState, steps: list[dict[str, float]],
           trial: Optional[TrialContext] = None) -> Decided:
    """The early-stop verdict after a round (KL budget, val patience, non-finite steps); in a
    sweep's trial (`trial` given), also the study's pruner on this round's val score."""
    if state.stop_reason:  # a segment's own decision stopped the run before its last round
        Deck(DECK, training_html(state, state.stop_reason))
        return Decided(state=state, stop=True, reason=state.stop_reason)
    new, verdict = decide_stop(state, steps, cfg)
    if trial is not None:
        new, verdict = check_pruning(trial, new, verdict, rounds_left=new.round < cfg.trainer.total_rounds)
    Deck(DECK, training_html(new, verdict.reason))
    print_round(cfg, new, steps)
    return Decided(state=new, stop=verdict.stop, reason=verdict.reason)


# In a local execution every round's `decide` runs in one process, so after its first line the
# clock times whole rounds, Flyte included; in a task's own pod, the first round's line takes its
# time from the round's stage timings.
_CLOCK = RoundClock()


def print_round(cfg: PPOConfig, state: RoundState, steps: list[dict[str, float]]) -> None:
    """The round's console line (as `rlhf.train` prints it, `report.print_round`)."""
    elapsed = launch_seconds()
    report.print_round(cfg, state, steps, float("nan") if elapsed is None else elapsed, _CLOCK)
