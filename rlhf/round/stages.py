"""The stages of a PPO round, as plain functions with typed inputs and outputs.

    prepare_data -> sample_prompts -> rollout -> score -> (to_buffer) update -> evaluate -> decide

(the starting policy: `rlhf.round.policy`; validation: `rlhf.round.evaluate`; the decision:
`rlhf.round.state`).

The in-process loop (`rlhf.train`) composes them; each Flyte task wraps exactly one;
the Flyte workflow composes them in the same order. Tables that cross stage
boundaries follow the pandera models in `schemas/`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from rlhf.config.checks import GROUP_ESTIMATORS
from rlhf.config.schema import PPOConfig
from rlhf.config.sizes import derive_sizes
from rlhf.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from rlhf.round.partition import balanced_rows
from rlhf.round.state import RoundState
from rlhf.trainer.batch import PPOBatch, collate
from rlhf.data.arithmetic import make_splits
from rlhf.data.sampling import PromptSampler, filter_overlong, tokenize_prompts
from rlhf.rewards import REWARDS, compute_scores, load_reward_model as _load
from rlhf.trainer.faults import oom_as_recoverable, rollout_memory_settings

log = logging.getLogger(__name__)


@dataclass
class DataBundle:
    train: pd.DataFrame  # PromptSchema
    val: pd.DataFrame  # PromptSchema
    sft: pd.DataFrame | None  # PromptSchema, labeled problems for the default warm-start


# -- prepare ----------------------------------------------------------------------------------


def prepare_data(cfg: PPOConfig) -> DataBundle:
    """Read the configured parquet files, or build the synthetic arithmetic splits."""
    d = cfg.data
    if d.train_files:
        from rlhf.data.io import read_prompts  # loads pyarrow and pandera: only for data from files

        train = read_prompts(d.train_files, drop_invalid=d.drop_invalid, base_dir=d.base_dir)
        if not d.val_files:
            raise ValueError("data.train_files is set but data.val_files is empty; give a validation parquet")
        val = read_prompts(d.val_files, drop_invalid=d.drop_invalid, base_dir=d.base_dir)
        check_data_sources(train, val, ", ".join(d.train_files), ", ".join(d.val_files))
        return DataBundle(train=train, val=val, sft=None)

    splits = make_splits(d.synthetic)
    return DataBundle(train=splits["train"], val=splits["val"], sft=splits["sft"])


def check_data_sources(train: pd.DataFrame, val: pd.DataFrame, train_name: str, val_name: str) -> None:
    """Before any training: every rule-scored row's `data_source` has a reward function, and
    every source trained on has validation rows (else its `val-core/<source>` metric is missing
    and early stopping would not see it). Raises `DataValidationError` naming file, rows, source."""
    from rlhf.data.io import DataValidationError  # loads pyarrow and pandera: only for data from files

    for df, name in ((train, train_name), (val, val_name)):
        rule = df[(df["reward_style"] == "rule") & ~df["data_source"].isin(REWARDS.names())]
        for source, rows in rule.groupby("data_source", sort=True).groups.items():
            shown = ", ".join(str(r) for r in list(rows)[:5]) + (" ..." if len(rows) > 5 else "")
            raise DataValidationError(
                f"{name}: data_source {source!r} (rows {shown}) has no reward function; known: "
                f"{', '.join(REWARDS.names())}. Register one before training with "
                f"rlhf.rewards.REWARDS.add({source!r}, fn), fix the column, or score these rows with a reward "
                "model (reward_style 'model' and reward.model_path)")
    missing = sorted(set(train["data_source"]) - set(val["data_source"]))
    if missing:
        raise DataValidationError(
            f"{val_name}: no validation rows for data_source(s) {', '.join(map(repr, missing))}, which "
            f"{train_name} trains on; add rows of each source to data.val_files (its val-core/<source> "
            "metrics and early stopping depend on them), or drop that source from data.train_files")


# -- sample -----------------------------------------------------------------------------------


def sample_prompts(train: pd.DataFrame, state: RoundState, cfg: PPOConfig) -> tuple[pd.DataFrame, RoundState]:
    """The round's prompts (`steps_per_round` batches of `train_batch_size` rows), from a seeded
    per-epoch shuffle whose last partial batch is dropped, as verl's loader drops it; the
    sampler position is carried in the state."""
    sampler = PromptSampler(len(train), cfg.data.train_batch_size, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle,
                            drop_last=True)
    sampler.load_state_dict({"epoch": state.epoch, "cursor": state.cursor})
    idx = np.concatenate([sampler.next_indices() for _ in range(cfg.trainer.steps_per_round)])
    pos = sampler.state_dict()
    new = RoundState(**{**state.__dict__, "epoch": pos["epoch"], "cursor": pos["cursor"]})
    return train.iloc[idx].reset_index(drop=True), new


def shard(df: pd.DataFrame, steps: int, rank: int, world: int) -> pd.DataFrame:
    """This rank's rows: each step's block of rows split into `world` contiguous parts."""
    if world == 1:
        return df
    per_step = len(df) // steps
    if per_step % world:
        raise ValueError(f"{per_step} rows per step cannot be split over {world} ranks")
    part = per_step // world
    blocks = [df.iloc[s * per_step + rank * part: s * per_step + (rank + 1) * part] for s in range(steps)]
    return pd.concat(blocks).reset_index(drop=True)


def shard_for_update(df: pd.DataFrame, cfg: PPOConfig, rank: int, world: int,
                     lengths: Sequence[int] | None = None) -> pd.DataFrame:
    """This rank's rows of a scored table for the update: with `trainer.balance_batch` and
    more than one rank, each global PPO mini-batch of each step split into `world` parts of
    equal row count and near-equal tokens (`balanced_rows`), so that the rank's i-th
    mini-batch is its part of the i-th global one; otherwise `shard`'s contiguous split.
    Every rank computes the same partition from the same table. `lengths`: tokens per row
    (default: prompt plus response ids of the table); GRPO keeps each `group_id` on one rank."""
    steps = cfg.trainer.steps_per_round
    if world == 1 or not cfg.trainer.balance_batch:
        return shard(df, steps, rank, world)
    if lengths is None:
        lengths = token_lengths(df)
    groups = df["group_id"].tolist() if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS else None
    parts, why = balanced_rows(lengths, steps, world, derive_sizes(cfg, world).mini_batch_responses, groups)
    if parts is None:
        if why not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add(why)
            log.info("trainer.balance_batch: %s; each step's rows are split contiguously over the ranks", why)
        return shard(df, steps, rank, world)
    return df.iloc[parts[rank]].reset_index(drop=True)


_FALLBACK_LOGGED: set[str] = set()


def token_lengths(df: pd.DataFrame) -> list[int]:
    """Tokens of each row of a rollout table: prompt plus response ids."""
    return [len(json.loads(p)) + len(json.loads(r)) for p, r in zip(df["prompt_ids"], df["response_ids"])]


def step_major(frames: Sequence[pd.DataFrame], steps: int) -> pd.DataFrame:
    """The ranks' tables (rank order) as one table in the order `shard` splits: for each step,
    rank 0's block of that step, rank 1's, ...; each table holds its `steps` blocks in turn.
    `group_id`s are offset per rank so that groups of different ranks never share an id."""
    shifted, offset = [], 0
    for f in frames:
        ids = f["group_id"].astype(np.int64) + offset
        shifted.append(f.assign(group_id=ids))
        offset = int(ids.max()) + 1 if len(f) else offset
    blocks = [f.iloc[s * (len(f) // steps):(s + 1) * (len(f) // steps)] for s in range(steps) for f in shifted]
    return pd.concat(blocks).reset_index(drop=True)


def rank_token_imbalance(lengths: Sequence[int], rank_rows: Sequence[Sequence[int]], mini_per_gpu: int) -> float:
    """Max over mini-batches of (tokens of the heaviest rank / mean tokens per rank), each
    rank's mini-batches being consecutive runs of `mini_per_gpu` of its rows: 1.0 is even."""
    n_mini = min(len(r) for r in rank_rows) // mini_per_gpu
    worst = 1.0
    for m in range(n_mini):
        tok = [sum(int(lengths[i]) for i in r[m * mini_per_gpu:(m + 1) * mini_per_gpu]) for r in rank_rows]
        mean = sum(tok) / len(tok)
        if mean > 0:
            worst = max(worst, max(tok) / mean)
    return worst


def fit_prompts(df: pd.DataFrame, tokenizer, cfg: PPOConfig, split: str) -> pd.DataFrame:
    """With `data.filter_overlong_prompts`, the rows of `df` whose prompt fits in
    `data.max_prompt_length` tokens (the dropped rows are counted in the log); otherwise `df`
    as it is (`data.truncation` then decides at rollout). Raises when no row fits."""
    d = cfg.data
    if not d.filter_overlong_prompts or len(df) == 0:
        return df

    kept = filter_overlong(df, tokenizer, d.max_prompt_length, d.prompt_format)
    dropped = kept.attrs.get("n_overlong", 0)
    if dropped and len(kept) == 0:
        raise ValueError(f"every one of the {len(df)} {split} prompts is longer than data.max_prompt_length="
                         f"{d.max_prompt_length} tokens; raise data.max_prompt_length or shorten the prompts")
    if dropped:
        log.warning("dropped %d of %d %s prompts longer than data.max_prompt_length=%d tokens "
                    "(data.filter_overlong_prompts)", dropped, len(df), split, d.max_prompt_length)
    return kept


def fit_data(data: DataBundle, tokenizer, cfg: PPOConfig) -> DataBundle:
    """`fit_prompts` on the train and val tables."""
    return DataBundle(train=fit_prompts(data.train, tokenizer, cfg, "train"),
                      val=fit_prompts(data.val, tokenizer, cfg, "val"), sft=data.sft)


# -- rollout ----------------------------------------------------------------------------------


def tokenize(prompts: pd.DataFrame, tokenizer, cfg: PPOConfig) -> list[list[int]]:
    return tokenize_prompts(prompts["prompt"].tolist(), tokenizer, cfg.data.max_prompt_length,
                            truncation=cfg.data.truncation, prompt_format=cfg.data.prompt_format)


def sampling_params(cfg: PPOConfig, seed: int | None = None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_tokens=cfg.data.max_response_length, seed=seed)


def rollout(engine: RolloutEngine, tokenizer, prompts: pd.DataFrame, cfg: PPOConfig, seed: int) -> pd.DataFrame:
    """Sample `rollout.n` responses per prompt; returns a RolloutSchema table (prompt groups contiguous).
    Out of device memory raises `RecoverableOOMError` naming the rollout settings to lower."""
    from schemas.prompts import dump_json_column  # loads pandera: only once a round runs

    ids = tokenize(prompts, tokenizer, cfg)
    with oom_as_recoverable("rollout", rollout_memory_settings(cfg)):
        batch: RolloutBatch = engine.generate(ids, sampling_params(cfg, seed))
    rows = prompts.iloc[batch.prompt_index].reset_index(drop=True)
    out = rows.assign(
        response=batch.response_text,
        prompt_ids=dump_json_column(batch.prompt_ids),
        response_ids=dump_json_column(batch.response_ids),
        group_id=np.asarray(batch.group_ids, dtype=np.int64),
        rollout_logprobs=dump_json_column(batch.logprobs),
        finish_reason=batch.finish_reason,
    )
    return out


def rollout_metrics(rollouts: pd.DataFrame, cfg: PPOConfig) -> dict[str, float]:
    lengths = np.array([len(json.loads(r)) for r in rollouts["response_ids"]], dtype=np.float64)
    p_lengths = np.array([len(json.loads(r)) for r in rollouts["prompt_ids"]], dtype=np.float64)
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((rollouts["finish_reason"] == "length").mean()),
        "prompt_length/mean": float(p_lengths.mean()),
    }


# -- score ------------------------------------------------------------------------------------


def score(rollouts: pd.DataFrame, cfg: PPOConfig, reward_model=None) -> pd.DataFrame:
    """Add the reward function's (or reward model's) `score` column: a ScoredRolloutSchema table."""
    extra = [json.loads(x) if x else {} for x in rollouts["extra_info"]]
    gts = [None if pd.isna(g) else g for g in rollouts["ground_truth"]]
    scores = compute_scores(rollouts["data_source"].tolist(), rollouts["response"].tolist(), gts, extra,
                            rollouts["reward_style"].tolist(), cfg.reward, reward_model=reward_model,
                            prompts=rollouts["prompt"].tolist())
    return rollouts.assign(score=np.asarray(scores, dtype=np.float64))


def load_reward_model(cfg: PPOConfig, device: torch.device):
    return _load(cfg.reward, device=str(device))


# -- update -----------------------------------------------------------------------------------


def to_buffer(scored: pd.DataFrame, pad_id: int, cfg: PPOConfig) -> PPOBatch:
    """The scored table as the trainer's tensor layout (prompt width from the config)."""
    from schemas.prompts import load_json_column  # loads pandera: only once a round runs

    return collate(
        prompt_ids=load_json_column(scored["prompt_ids"]),
        response_ids=load_json_column(scored["response_ids"]),
        scores=scored["score"].astype(float).tolist(),
        group_ids=scored["group_id"].astype(int).tolist(),
        pad_id=pad_id,
        rollout_log_probs=load_json_column(scored["rollout_logprobs"]),
        prompt_width=cfg.data.max_prompt_length,
        response_width=cfg.data.max_response_length,
    )


def update(trainer, scored: pd.DataFrame, pad_id: int, cfg: PPOConfig) -> list[dict[str, float]]:
    """`steps_per_round` PPO steps over this rank's share of the round's scored rollouts."""
    buf = to_buffer(scored, pad_id, cfg).to(trainer.device)
    return trainer.round(buf, cfg.trainer.steps_per_round)


# -- evaluate ---------------------------------------------------------------------------------


def val_score(metrics: dict[str, float]) -> float:
    """The one number early stopping, checkpoints and sweeps compare: mean val reward."""
    return float(metrics["val/reward/mean"])


def check_sizes(cfg: PPOConfig, world: int) -> None:
    sizes = derive_sizes(cfg, world)
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and cfg.data.train_batch_size % world:
        raise ValueError(f"{cfg.algorithm.adv_estimator} keeps each prompt's group on one rank: data.train_batch_size "
                         f"({cfg.data.train_batch_size}) must be divisible by the {world} ranks")
    del sizes
