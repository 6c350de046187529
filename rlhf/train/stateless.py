"""One round's stages for a driver that keeps nothing in memory between them.

`rlhf.train.Run` holds the policy, critic and optimizer in one process across rounds.
A stateless driver (one Flyte task per stage) instead passes files and small values:

    prepare_dataset -> prepare_base_model -> [sample_prompts -> rollout_policy -> score_rollouts
        -> update_from_checkpoint -> evaluate_policy -> decide] x rounds

Each function here loads what it needs (a model directory, a checkpoint with the
DeepSpeed optimizer state), runs one stage from `rlhf.round.stages`, and returns tables,
directories and the `RoundState`. Both drivers follow the rules defined here (rollout
and update seeds, the validation schedule, the state after an update, the per-step
metrics, the summary) and share the set-up of `rlhf.train.setup` (device and process
group, trainer, rollout engine, tracking sink, validation, the checkpoint save), so the
same config and seed give the same rounds either way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import pandas as pd
import torch

from rlhf.round import checkpoint as ckpt
from rlhf.round import stages
from rlhf.config.schema import DataConfig, ModelConfig, PPOConfig, TrainerConfig
from rlhf.round.state import RoundState, record_steps
import rlhf.train.setup as S

# ---------------------------------------------------------------------------------
# Rules both drivers follow
# ---------------------------------------------------------------------------------


def rollout_seed(cfg: PPOConfig, round_: int, rank: int = 0) -> int:
    """The sampling seed of round `round_` (rounds completed before it) on `rank`."""
    return cfg.trainer.seed * 100003 + round_ * 1009 + rank


def update_seed(cfg: PPOConfig, round_: int, rank: int = 0) -> int:
    """The global torch seed of round `round_`'s update on `rank` (dropout draws from it): a
    function of the round alone, so a resumed run draws what an uninterrupted one would."""
    return rollout_seed(cfg, round_, rank) + 7919


def should_evaluate(cfg: PPOConfig, rounds_done: int) -> bool:
    """Validate after round `rounds_done` (1-based): every `test_freq` rounds and after the last;
    never with `test_freq=-1`."""
    if cfg.trainer.test_freq <= 0:
        return False
    return rounds_done % cfg.trainer.test_freq == 0 or rounds_done == cfg.trainer.total_rounds


def should_validate_first(cfg: PPOConfig, state: RoundState) -> bool:
    """Validate the starting policy before any update (`trainer.val_before_train`)."""
    return cfg.trainer.val_before_train and cfg.trainer.test_freq > 0 and state.round == 0 and state.val_start < 0


def record_update(state: RoundState, steps: list[dict[str, float]], kl_coef: float) -> RoundState:
    """The state after a round's update: step history, global step, KL coefficient, round + 1."""
    new = record_steps(state, steps)
    return replace(new, kl_coef=float(kl_coef), round=state.round + 1)


def offline_table(cfg: PPOConfig, tokenizer) -> Optional[pd.DataFrame]:
    """The stored rollouts of `data.rollout_files` (offline RLHF, `rlhf.round.offline`), or None."""
    if not cfg.data.rollout_files:
        return None
    from rlhf.round.offline import load_rollouts

    return load_rollouts(cfg, tokenizer)


def offline_round(table: pd.DataFrame, cfg: PPOConfig, round_: int, rank: int, world: int, reward_model=None
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rollouts, scored) of round `round_` (rounds done before it) from the stored table."""
    from rlhf.round.offline import offline_round as _round

    return _round(table, cfg, round_, rank, world, reward_model)


def store_rollouts(cfg: PPOConfig, scored: pd.DataFrame, round_: int, rank: int = 0) -> None:
    """Write round `round_`'s (1-based) scored rollouts under `trainer.rollout_data_dir`, if set:
    the input format of offline RLHF (`data.rollout_files`)."""
    if cfg.trainer.rollout_data_dir:
        from rlhf.data.rollouts import write_round_rollouts

        write_round_rollouts(cfg.trainer.rollout_data_dir, scored, round_, rank)


def count_tokens(rollouts: pd.DataFrame) -> float:
    """Prompt plus response tokens of a rollout table."""
    return float(sum(stages.token_lengths(rollouts)))


def step_metrics(steps: list[dict[str, float]], gen: dict[str, float], timing: dict[str, float], tokens: float,
                 world: int, trainer, device: torch.device) -> list[dict[str, float]]:
    """Each PPO step's metrics completed with the round's rollout metrics, its share of the
    round's stage timings (and their sum, `timing_s/step`), throughput and MFU."""
    out = []
    for m in steps:
        m = {**m, **gen, **{k: v / len(steps) for k, v in timing.items()},
             "timing_s/step": sum(timing.values()) / len(steps)}
        m.update(perf_metrics(m, tokens / len(steps), world, trainer, device))
        out.append(m)
    return out


def perf_metrics(m: dict[str, float], tokens: float, world: int, trainer, device: torch.device
                 ) -> dict[str, float]:
    """Throughput (tokens per second per GPU over the update) and actor MFU from 6 * params * tokens."""
    upd = m.get("timing_s/update", 0.0)
    out = {"perf/total_num_tokens": tokens}
    if upd > 0:
        out["perf/throughput"] = tokens / upd / world
        n_params = sum(p.numel() for p in trainer.actor.module.parameters())
        actor_t = m.get("timing_s/update_actor", upd)
        peak = peak_flops(device)
        if peak and actor_t > 0:
            out["perf/mfu/actor"] = 6.0 * n_params * tokens * trainer.cfg.actor.ppo_epochs / actor_t / world / peak
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        import resource

        out["perf/cpu_memory_used_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def peak_flops(device: torch.device) -> float:
    """Dense bf16 peak of the device in FLOP/s ($RLHF_PEAK_TFLOPS overrides; 790 measured on H200)."""
    if os.environ.get("RLHF_PEAK_TFLOPS"):
        return float(os.environ["RLHF_PEAK_TFLOPS"]) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return 790e12 if "H200" in name or "H100" in name else 312e12
    return 0.0


# ---------------------------------------------------------------------------------
# Preparation (cacheable: the outputs depend only on these inputs)
# ---------------------------------------------------------------------------------


def prepare_dataset(data: DataConfig) -> stages.DataBundle:
    """Train and val prompt tables and the labeled SFT split (of the synthetic task, else up to
    `data.synthetic.n_sft` labeled user rows, which warm-start the tiny default model; empty
    when the user data has none) from the data section alone."""
    from rlhf.data.checks import labeled_rows

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
    from rlhf.data.io import list_parquet_files, resolve_path

    h = hashlib.sha256()
    for path in (data.train_files, data.val_files):
        if not path:
            continue
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
    return stages.prepare_policy(cfg, out_dir, data)


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


@dataclass
class UpdateResult:
    checkpoint: str  # the new checkpoint directory (actor/, critic/, engine/, state.json, config.yaml)
    state: RoundState
    steps: list[dict[str, float]]  # full per-step metrics
    timing: dict[str, float] = field(default_factory=dict)  # seconds: load, restore, update, save

    @property
    def policy(self) -> str:
        """The updated policy: a `save_pretrained` directory with the tokenizer."""
        return str(Path(self.checkpoint) / "actor")


def update_from_checkpoint(cfg: PPOConfig, base_model_dir: str, checkpoint_dir: Optional[str],
                           scored: pd.DataFrame, state: RoundState, out_dir: str, sink=None) -> UpdateResult:
    """`steps_per_round` PPO steps over the round's scored rollouts, starting from checkpoint
    `checkpoint_dir` (weights, DeepSpeed optimizer state; its files checked against their
    digests first) or, for the first round, from the base policy; saves the new checkpoint
    atomically under `out_dir` and returns it with the new state and the step metrics.
    Profiler traces of the round (`trainer.profile_steps`) go inside the new checkpoint
    (`profile/`). Every round writes a checkpoint (the next round starts from it); of those
    under `out_dir`, the newest stays and, beyond it, the newest `trainer.max_ckpt_to_keep`
    of the rounds `trainer.save_freq` picks (`setup.save_checkpoint`).

    Under torchrun every rank calls this with the same arguments: each trains on its shard
    of the rows and writes its optimizer shards; rank 0's `out_dir` is used by all ranks.
    """
    proc = S.start_process(cfg, out_dir)
    timing: dict[str, float] = {}
    resume = Path(checkpoint_dir) if checkpoint_dir else None
    t = time.perf_counter()
    if resume:
        S.verify_checkpoint(resume, proc.rank)
    timing["timing_s/verify_checkpoint"] = time.perf_counter() - t
    tokenizer = S.load_tokenizer(cfg, base_model_dir)
    trainer, _ = S.load_trainer(cfg, proc.sizes, base_model_dir, proc.device, resume, state, timing)
    traces = proc.out / f".profile_{ckpt.round_dir_name(state.round + 1)}"
    steps = _update(cfg, trainer, tokenizer, stages.shard_for_update(scored, cfg, proc.rank, proc.world), state,
                    proc, traces, sink if proc.rank == 0 else None, timing)
    steps = step_metrics(steps, stages.rollout_metrics(scored, cfg), {"timing_s/update": timing["timing_s/update"]},
                         count_tokens(scored), proc.world, trainer, proc.device)
    if sink is not None and proc.rank == 0:
        for i, m in enumerate(steps):
            sink.log_metrics(m, step=state.global_step + i + 1)
    new = record_update(state, steps, trainer.kl_ctrl.value)
    t = time.perf_counter()
    final = S.save_checkpoint(proc.out, trainer, tokenizer, cfg, new, extra={"profile": traces / "profile"},
                              on_sealed=lambda path: shutil.rmtree(traces, ignore_errors=True))
    timing["timing_s/save_checkpoint"] = time.perf_counter() - t
    return UpdateResult(checkpoint=str(final), state=new, steps=steps, timing=timing)


def _update(cfg: PPOConfig, trainer, tokenizer, local: pd.DataFrame, state: RoundState, proc: S.Process,
            traces: Path, sink, timing: dict[str, float]) -> list[dict[str, float]]:
    """The round's PPO steps on this rank's rows `local`, with the round's update seed; the
    profiled steps' traces go under `traces`; `timing_s/update` to `timing`."""
    from rlhf.tracking.profiling import StepProfiler

    profiler = StepProfiler(cfg.trainer.profile_steps, traces, proc.device, proc.rank)
    t = time.perf_counter()
    torch.manual_seed(update_seed(cfg, state.round, proc.rank))
    with profiler.update(state.global_step + 1, cfg.trainer.steps_per_round, sink):
        steps = stages.update(trainer, local, tokenizer.pad_token_id, cfg)
    timing["timing_s/update"] = time.perf_counter() - t
    return steps


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


# ---------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------


def stop_reason(cfg: PPOConfig, state: RoundState) -> str:
    """Why the rounds ended: the early-stop reason, or the round budget."""
    if state.stop_reason:
        return state.stop_reason
    return "total_rounds reached" if state.round >= cfg.trainer.total_rounds else ""


def summary(cfg: PPOConfig, state: RoundState) -> dict:
    """The run summary both drivers report (`rlhf.train` adds wall time and paths)."""
    return {
        "val_score_start": state.val_start,
        "val_score_end": state.last_val,
        "val_score_best": state.best_val,
        "rounds": state.round,
        "global_steps": state.global_step,
        "stop_reason": stop_reason(cfg, state),
        "kl_coef": state.kl_coef,
        "skipped_steps": state.skipped_steps,
        "val_history": state.val_history,
    }


def metrics_table(state: RoundState) -> pd.DataFrame:
    """One row per PPO step (`step` and the history metrics), plus one row per validation
    without a step of its own (e.g. before training); `val/score` where validated."""
    steps = pd.DataFrame(state.step_history or {"step": []})
    vals = pd.DataFrame({"step": [v["step"] for v in state.val_history],
                         "val/score": [v["score"] for v in state.val_history]})
    table = steps.merge(vals, on="step", how="outer").sort_values("step", kind="stable").reset_index(drop=True)
    table["step"] = table["step"].astype("int64")
    return table
