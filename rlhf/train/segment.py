"""A colocated segment: K consecutive rounds in one process group, as the in-process
driver runs them (`rlhf.train.inprocess.run_rounds`), started from a checkpoint and a `RoundState`.

    run_segment(cfg, base_dir, train, val, checkpoint, state, out_dir)  -> SegmentResult

The Flyte task `tasks.segment.ppo_segment` wraps it under torchrun (kfpytorch `Elastic`);
a GPU benchmark can call it directly. The segment covers the rounds after `state.round`
up to `segment_end(cfg, start_round)`; its last round stops after the update, because the
round's validation and early-stop decision run between segments (in the workflow, where
they have their own tasks and decks). Every `trainer.save_freq` rounds inside the segment
a checkpoint is written and handed to `on_checkpoint` (the task uploads it as the Flyte
intratask checkpoint); a retried task passes the newest one back as `resume`, and the
segment goes on from there with the state saved in it, so a retry loses at most the rounds
since that checkpoint. The segment always ends with a checkpoint (the next segment's start).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pandas as pd

from rlhf.checkpoint import rounds as ckpt
from rlhf.round import stages
from rlhf.config.schema import PPOConfig
from rlhf.round.state import RoundState
from rlhf.train.inprocess import Run, run_rounds
from rlhf.train.step import StepResult
from rlhf.trainer import dist as D


@dataclass
class SegmentResult:
    checkpoint: str  # the checkpoint after the segment's last round (actor/, critic/, engine/, state.json)
    state: RoundState  # after the last update (its validation and decision are the caller's)
    steps: list[dict[str, float]]  # the last round's per-step metrics (what `decide` reads)
    metrics: pd.DataFrame  # one row per PPO step of the segment: `step` and every step metric
    rollouts: pd.DataFrame  # the last round's rollouts (RolloutSchema), all ranks' rows
    scored: pd.DataFrame  # the same rows with their scores (ScoredRolloutSchema)
    stopped: bool  # an early stop inside the segment ended it before `segment_end`

    @property
    def policy(self) -> str:
        """The policy after the segment: a `save_pretrained` directory with the tokenizer."""
        return str(Path(self.checkpoint) / "actor")


def segment_end(cfg: PPOConfig, start_round: int) -> int:
    """The round a segment starting after `start_round` completed rounds ends at: the next
    multiple of `trainer.rounds_per_segment`, at most `trainer.total_rounds`."""
    k = cfg.trainer.rounds_per_segment
    return min((start_round // k + 1) * k, cfg.trainer.total_rounds)


def segment_starts(cfg: PPOConfig) -> list[int]:
    """The completed-round counts the segments of a run start from: 0, K, 2K, ... below R."""
    return list(range(0, cfg.trainer.total_rounds, cfg.trainer.rounds_per_segment))


def should_save(cfg: PPOConfig, rounds_done: int, end: int) -> bool:
    """An intratask checkpoint after round `rounds_done`: every `trainer.save_freq` rounds
    (counted from the run's start, so a retry and an uninterrupted run save the same rounds),
    never at the segment's end, which writes its own (and before the run's last round, so
    `is_save_point`'s last-round rule never applies here)."""
    return rounds_done < end and ckpt.is_save_point(cfg.trainer, rounds_done)


def run_segment(cfg: PPOConfig, base_dir: str, train: pd.DataFrame, val: pd.DataFrame,
                checkpoint: Optional[str], state: RoundState, out_dir: str, sink=None,
                resume: Optional[str] = None, on_checkpoint: Callable[[Path], None] = lambda path: None,
                on_round: Callable = lambda run, result: None) -> SegmentResult:
    """The rounds after `state.round` up to `segment_end`, from checkpoint `checkpoint` (None:
    the base policy) or, when a retried task found one, from its own newer checkpoint `resume`
    (the state saved there wins). Every rank of the process group calls it with the same
    arguments; `on_checkpoint` (called once a checkpoint is sealed, in the checkpoint writer's
    thread) and the returned tables are rank 0's business; `on_round(run, result)` runs after every
    round (progress, benchmarks), with the round's update (`step.StepResult`)."""
    end = segment_end(cfg, state.round)
    if state.round >= cfg.trainer.total_rounds:
        raise ValueError(f"the run is at round {state.round} of trainer.total_rounds={cfg.trainer.total_rounds}: "
                         "no round is left for a segment; raise trainer.total_rounds to train on")
    run = Run.start(cfg, base_dir, train, val, Path(checkpoint) if checkpoint else None, state, out_dir, sink=sink,
                    resume=Path(resume) if resume else None)
    first_step = state.global_step

    def after_round(r: Run, result: StepResult) -> None:
        # At a save point the checkpoint is written, sealed and then uploaded in the writer's thread
        # while the next rounds run (a failed attempt waits for it in `close`; its retry resumes
        # from it); before the first one, the writer's host buffers are allocated meanwhile.
        r.checkpoint(save=should_save(cfg, r.state.round, end), on_sealed=on_checkpoint)
        on_round(r, result)

    try:
        verdict, last = run_rounds(run, end, decide_last=False, after_round=after_round)
        assert last is not None, "the segment ran no round"
        final = run.save()
        run.flush()
        rollouts = _all_rows(last.rollouts, cfg, run.world)
        scored = _all_rows(last.scored, cfg, run.world)
    finally:
        run.close(close_sink=False)  # the sink is the task's
    table = _steps_table(run.state, first_step)
    return SegmentResult(checkpoint=str(final), state=run.state, steps=last.steps, metrics=table,
                         rollouts=rollouts, scored=scored, stopped=verdict.stop)


def _all_rows(local: pd.DataFrame, cfg: PPOConfig, world: int) -> pd.DataFrame:
    """Every rank's rows of a round table, in the round's step-major order."""
    if world == 1:
        return local
    return stages.step_major(D.all_gather_object(local), cfg.trainer.steps_per_round)


def _steps_table(state: RoundState, first_step: int) -> pd.DataFrame:
    rows = [r for r in state.step_history if r["step"] > first_step]
    table = pd.DataFrame(rows or {"step": []})
    table["step"] = table["step"].astype("int64")
    return table
