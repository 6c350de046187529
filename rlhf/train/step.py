"""A round's update half, the same for every driver: the in-process driver and a colocated
segment (`rlhf.train.inprocess.Run`) and the update stage task (`rlhf.train.stateless`).

    update_step(cfg, trainer, tokenizer, state, rows, proc, sink, profiler, hooks) -> StepResult

Its stages, in order, each under one timer (`timing_s/<stage>`):

1. `store_rollouts`: the round's scored rows written under `trainer.rollout_data_dir` (when
   set), and a first round that scored nothing warned of;
2. `update`: this rank's share of the rows, the round's update seed, the PPO steps (profiled
   on `trainer.profile_steps`), less the time the first optimizer step waited for the copy of
   an earlier checkpoint (`timing_s/checkpoint_wait`);
3. `update_weights`: the updated weights handed to the rollout engine;

then the per-step metrics (the round's rollout metrics, the stage timings with the
generation's, throughput, MFU), each step logged to the sink, and the state moved on. A
driver differs only in its `Hooks` and in the `RoundRows` it hands over.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import pandas as pd
import torch

from rlhf.config.schema import PPOConfig
from rlhf.data.rollouts import write_round_rollouts
from rlhf.round import rules, stages
from rlhf.round.state import RoundState
from rlhf.trainer import dist as D


@dataclass(frozen=True)
class RoundRows:
    """A round's rows as a driver hands them to `update_step`."""

    rollouts: pd.DataFrame  # the rows the rollout metrics and the token count are taken from
    scored: pd.DataFrame  # the same rows with their scores (stored, and updated on)
    timing: dict[str, float] = field(default_factory=dict)  # seconds: `timing_s/gen`, `timing_s/reward`
    sharded: bool = True  # each rank holds its own share (else every rank holds the whole round)


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """What a driver adds to the update half."""

    share: Callable[[pd.DataFrame], pd.DataFrame] = lambda scored: scored  # this rank's rows for the update
    release: Callable[[], None] = _nothing  # before the update: room on the device (the engine's memory)
    stalled: Callable[[], float] = lambda: 0.0  # seconds the update waited for a checkpoint's copy
    sync: Callable[[], None] = _nothing  # after the update: the rollout engine given the new weights


@dataclass(frozen=True)
class StepResult:
    """The outcome of a round's update half."""

    steps: list[dict[str, float]]  # each PPO step's full metrics, as logged
    state: RoundState  # after the update: step history, global step, KL coefficient, round + 1
    timing: dict[str, float]  # seconds of the round's stages, the generation's included
    rollouts_path: str = ""  # the stored scored rollouts of this process ("" when none were stored)
    rollouts: Optional[pd.DataFrame] = None  # the round's rows as handed over (this rank's when sharded)
    scored: Optional[pd.DataFrame] = None


@contextmanager
def timer(timing: dict[str, float], key: str) -> Iterator[None]:
    """Add the seconds the block takes to `timing[key]`."""
    t = time.perf_counter()
    try:
        yield
    finally:
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - t


def store_rollouts(cfg: PPOConfig, scored: pd.DataFrame, round_: int, rank: int = 0) -> str:
    """Write round `round_`'s (1-based) scored rollouts under `trainer.rollout_data_dir`, if set:
    the input format of offline RLHF (`data.rollout_files`). Returns the file written ("" when none)."""
    if not cfg.trainer.rollout_data_dir:
        return ""
    return write_round_rollouts(cfg.trainer.rollout_data_dir, scored, round_, rank)


def update_step(cfg: PPOConfig, trainer, tokenizer, state: RoundState, rows: RoundRows, proc, sink, profiler,
                hooks: Hooks = Hooks()) -> StepResult:
    """The update half of round `state.round + 1` on `rows` (module docstring). `proc` is the
    process's place (`device`, `rank`, `world`: a `setup.Process` or a `Run`); `sink` gets each
    step's metrics (None: rank > 0, nothing logged); `profiler` is a `StepProfiler`."""
    round_ = state.round + 1
    timing = dict(rows.timing)
    with timer(timing, "timing_s/store_rollouts"):  # 1
        path = ""
        if rows.sharded or proc.rank == 0:
            path = store_rollouts(cfg, rows.scored, round_, proc.rank if rows.sharded else 0)
        rules.warn_if_unrewarded(rows.scored, round_, proc.rank)
    with timer(timing, "timing_s/update"):  # 2
        local = hooks.share(rows.scored)
        torch.manual_seed(rules.update_seed(cfg, state.round, proc.rank))
        hooks.release()
        with profiler.update(state.global_step + 1, cfg.trainer.steps_per_round, sink):
            steps = stages.update(trainer, local, tokenizer.pad_token_id, cfg)
    timing["timing_s/checkpoint_wait"] = hooks.stalled()
    timing["timing_s/update"] -= timing["timing_s/checkpoint_wait"]
    with timer(timing, "timing_s/update_weights"):  # 3
        hooks.sync()
    gen, tokens = stages.rollout_metrics(rows.rollouts, cfg), float(sum(stages.token_lengths(rows.rollouts)))
    if rows.sharded:
        gen, tokens = D.mean_across_ranks(gen), float(D.all_reduce_sum(torch.tensor(tokens)))
    steps = rules.step_metrics(steps, gen, timing, tokens, proc.world, trainer, proc.device)
    if sink is not None:
        for i, m in enumerate(steps):
            sink.log_metrics(m, step=state.global_step + i + 1)
    new = rules.record_update(state, steps, trainer.kl_ctrl.value)
    return StepResult(steps=steps, state=new, timing=timing, rollouts_path=path, rollouts=rows.rollouts,
                      scored=rows.scored)
