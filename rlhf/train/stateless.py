"""One round's stages for a driver that keeps nothing in memory between them.

`rlhf.train.Run` holds the policy, critic and optimizer in one process across rounds.
A stateless driver (one Flyte task per stage) instead passes files and small values:

    prepare_dataset -> prepare_base_model -> [sample_prompts -> rollout_policy -> score_rollouts
        -> update_from_checkpoint -> evaluate_policy -> decide] x rounds

Each function here loads what it needs (a model directory, a checkpoint with the
DeepSpeed optimizer state), runs one stage from `rlhf.round.stages`, and returns tables,
directories and the `RoundState`. Both drivers follow the rules of `rlhf.round.rules`
(rollout and update seeds, the validation schedule, the state after an update, the
per-step metrics; re-exported here, with the summary of `rlhf.train.report`), run the
update half of `rlhf.train.step` and share the set-up of `rlhf.train.setup` (device and
process group, trainer, rollout engine, tracking sink, validation, the checkpoint save), so
the same config and seed give the same rounds either way.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

from rlhf.checkpoint import rounds as ckpt
from rlhf.checkpoint import verify
from rlhf.data.checks import labeled_rows
from rlhf.data.io import list_parquet_files, resolve_path
from rlhf.round import stages
from rlhf.round.policy import prepare_policy
from rlhf.config.schema import DataConfig, ModelConfig, PPOConfig, TrainerConfig
from rlhf.round.state import RoundState
from rlhf.round.rules import (  # noqa: F401 (the stateless stages' API)
    metrics_table,
    peak_flops,
    perf_metrics,
    record_update,
    rollout_seed,
    should_evaluate,
    should_validate_first,
    step_metrics,
    update_seed,
    warn_if_unrewarded,
)
from rlhf.tracking.profiling import StepProfiler
import rlhf.train.setup as S
from rlhf.train.report import stop_reason, summary  # noqa: F401 (the stateless stages' API)
from rlhf.train.step import Hooks, RoundRows, timer, update_step

# ---------------------------------------------------------------------------------
# Preparation (cacheable: the outputs depend only on these inputs)
# ---------------------------------------------------------------------------------


def prepare_dataset(data: DataConfig) -> stages.DataBundle:
    """Train and val prompt tables and the labeled SFT split (of the synthetic task, else up to
    `data.synthetic.n_sft` labeled user rows, which warm-start the tiny default model; empty
    when the user data has none) from the data section alone."""
    bundle = stages.prepare_data(PPOConfig(data=data))
    if bundle.sft is None:
        sft = labeled_rows(bundle.train).head(data.synthetic.n_sft)
        bundle = stages.DataBundle(train=bundle.train, val=bundle.val, sft=sft)
    return bundle


def dataset_fingerprint(data: DataConfig) -> str:
    """A digest of the dataset files behind `data` (paths, sizes, modification times or
    ETags), so that a cache keyed on it misses when the files change; "" for the synthetic
    task, whose rows the config alone determines."""
    if not data.train_files:
        return ""
    h = hashlib.sha256()
    for path in [*data.train_files, *data.val_files]:
        fs, files = list_parquet_files(resolve_path(path, data.base_dir))
        for f in files:
            info = fs.info(f)
            stamp = [info.get(k) for k in ("size", "mtime", "LastModified", "ETag", "etag", "md5Hash", "updated")]
            h.update(json.dumps([f, stamp], default=str).encode())
    return h.hexdigest()[:16]


def prepare_base_model(model: ModelConfig, seed: int, sft: pd.DataFrame, out_dir: str) -> str:
    """The starting (and reference) policy directory: `model.path`, or the tiny default
    model built and SFT-warm-started on `sft` into `out_dir`."""
    cfg = PPOConfig(model=model, trainer=TrainerConfig(seed=seed))
    data = stages.DataBundle(train=sft.iloc[:0], val=sft.iloc[:0], sft=sft if len(sft) else None)
    return prepare_policy(cfg, out_dir, data)


# ---------------------------------------------------------------------------------
# One round, stage by stage
# ---------------------------------------------------------------------------------


def rollout_policy(cfg: PPOConfig, model_dir: str, prompts: pd.DataFrame, state: RoundState
                   ) -> tuple[pd.DataFrame, dict[str, float]]:
    """`rollout.n` sampled responses per prompt from the policy saved in `model_dir`
    (a RolloutSchema table) and the rollout metrics, with the round's seed."""
    device = S.pick_device(cfg)
    t = time.perf_counter()
    engine, tokenizer = S.policy_engine(cfg, model_dir, device)
    built = time.perf_counter()
    try:
        rollouts = stages.rollout(engine, tokenizer, prompts, cfg, seed=rollout_seed(cfg, state.round))
    finally:
        engine.close()
    metrics = stages.rollout_metrics(rollouts, cfg)
    metrics["timing_s/gen"] = time.perf_counter() - t
    metrics["timing_s/gen_engine_build"] = built - t  # loading the policy and building the engine
    return rollouts, metrics


def score_rollouts(cfg: PPOConfig, rollouts: pd.DataFrame) -> pd.DataFrame:
    """The rollouts with their reward (ScoredRolloutSchema)."""
    reward_model = stages.load_reward_model(cfg, S.pick_device(cfg))
    return stages.score(rollouts, cfg, reward_model)


def score_timed(cfg: PPOConfig, rollouts: pd.DataFrame, timing: dict[str, float]
                ) -> tuple[pd.DataFrame, dict[str, float]]:
    """`score_rollouts`, and the round's stage `timing` with the scoring's seconds added as
    `timing_s/reward` (the reward model's load included)."""
    out = dict(timing)
    with timer(out, "timing_s/reward"):
        scored = score_rollouts(cfg, rollouts)
    return scored, out


def gen_timing(metrics: dict[str, float]) -> dict[str, float]:
    """The stage timings of a round's generation among `rollout_policy`'s metrics, as the
    update's step metrics take them (`timing_s/gen`)."""
    return {"timing_s/gen": metrics["timing_s/gen"]}


@dataclass
class UpdateResult:
    checkpoint: str  # the new checkpoint directory (actor/, critic/, engine/, state.json, config.yaml)
    state: RoundState
    steps: list[dict[str, float]]  # full per-step metrics
    timing: dict[str, float] = field(default_factory=dict)  # seconds: load, restore, update, save
    rollouts_path: str = ""  # the round's scored rollouts stored under `trainer.rollout_data_dir` ("" none)

    @property
    def policy(self) -> str:
        """The updated policy: a `save_pretrained` directory with the tokenizer."""
        return str(Path(self.checkpoint) / "actor")


def update_from_checkpoint(cfg: PPOConfig, base_model_dir: str, checkpoint_dir: Optional[str],
                           scored: pd.DataFrame, state: RoundState, out_dir: str, sink=None,
                           timing: Optional[dict[str, float]] = None) -> UpdateResult:
    """`steps_per_round` PPO steps over the round's scored rollouts, starting from checkpoint
    `checkpoint_dir` (weights, DeepSpeed optimizer state; its files checked against their
    digests while the trainer is built, before the state is restored) or, for the first
    round, from the base policy; saves the new checkpoint atomically under `out_dir` and
    returns it with the new state and the step metrics. The update half is
    `step.update_step`'s (stored rollouts, the steps, their metrics with the generation's
    `timing`: `timing_s/gen`, `timing_s/reward`).
    Profiler traces of the round (`trainer.profile_steps`) go inside the new checkpoint
    (`profile/`). Every round writes a checkpoint (the next round starts from it); of those
    under `out_dir`, the newest stays and, beyond it, the newest `trainer.max_ckpt_to_keep`
    of the rounds `trainer.save_freq` picks (`setup.save_checkpoint`).

    Under torchrun every rank calls this with the same arguments: each trains on its shard
    of the rows and writes its optimizer shards; rank 0's `out_dir` is used by all ranks.
    """
    proc = S.start_process(cfg, out_dir)
    load_timing: dict[str, float] = {}
    resume = Path(checkpoint_dir) if checkpoint_dir else None
    verified = S.start_verify(resume, proc.rank) if resume else None  # hashed while the trainer is built
    tokenizer = S.load_tokenizer(cfg, base_model_dir)
    trainer, _, _ = S.load_first_valid(cfg, proc.sizes, base_model_dir, proc.device, [S.Start(resume, state)],
                                       verify.earlier_advice(state.checkpoints, str(resume)), verified=verified,
                                       timing=load_timing)
    traces = proc.out / f".profile_{ckpt.round_dir_name(state.round + 1)}"
    profiler = StepProfiler(cfg.trainer.profile_steps, traces, proc.device, proc.rank)
    hooks = Hooks(share=lambda rows: stages.shard_for_update(rows, cfg, proc.rank, proc.world))
    rows = RoundRows(rollouts=scored, scored=scored, timing=dict(timing or {}), sharded=False)
    result = update_step(cfg, trainer, tokenizer, state, rows, proc, sink if proc.rank == 0 else None, profiler,
                         hooks)
    t = time.perf_counter()
    final = S.save_checkpoint(proc.out, trainer, tokenizer, cfg, result.state, extra={"profile": traces / "profile"},
                              on_sealed=lambda path: shutil.rmtree(traces, ignore_errors=True))
    load_timing["timing_s/save_checkpoint"] = time.perf_counter() - t
    if sink is not None and proc.rank == 0:  # as the in-process driver logs its checkpoint step
        sink.log_metrics({"timing_s/save_checkpoint": load_timing["timing_s/save_checkpoint"]},
                         step=result.state.global_step)
    return UpdateResult(checkpoint=str(final), state=result.state, steps=result.steps,
                        timing={**load_timing, "timing_s/update": result.timing["timing_s/update"]},
                        rollouts_path=result.rollouts_path)


def evaluate_policy(cfg: PPOConfig, model_dir: str, val: pd.DataFrame, state: RoundState, sink=None
                    ) -> tuple[RoundState, dict[str, float]]:
    """Greedy validation of the policy saved in `model_dir`; the score is recorded in the state."""
    device = S.pick_device(cfg)
    t = time.perf_counter()
    engine, tokenizer = S.policy_engine(cfg, model_dir, device)
    built = time.perf_counter()
    try:
        new, metrics, samples = S.evaluate(engine, tokenizer, val, cfg, stages.load_reward_model(cfg, device), state)
    finally:
        engine.close()
    metrics["timing_s/testing"] = time.perf_counter() - t
    metrics["timing_s/testing_engine_build"] = built - t
    if sink is not None:
        S.log_evaluation(sink, new.global_step, metrics, samples, cfg.trainer.output_dir)
    return new, metrics
