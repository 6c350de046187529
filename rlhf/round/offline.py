"""Offline RLHF: a stored rollout table stands in for the rollout stage.

With `data.rollout_files` set, a round takes its `steps_per_round * train_batch_size *
rollout.n` responses from the stored table instead of generating them: round r takes the
table's block r mod (rows // block) of consecutive rows (whole groups, in table order), so
the rounds walk through the table and start over. Rows without a score are scored by the
reward function or model as generated ones are; rows with the behaviour policy's
log-probs (`rollout_logprobs`) are trained with rollout correction against them
(`algorithm.rollout_correction`): the IS weights pi_current / pi_behaviour are 1 where
the stored policy is the current one, and correct the update where it is not. Without
stored log-probs the behaviour policy is unknown and the round is plain PPO anchored at the
current policy (the data are treated as if sampled by it).

No rollout engine is built for training; greedy validation still needs one
(`trainer.test_freq=-1` and `trainer.val_before_train=false` run with none at all).
"""

from __future__ import annotations

from typing import Optional

import pandas as pd

from rlhf.round import stages
from rlhf.config.schema import PPOConfig
from rlhf.config.sizes import derive_sizes
from rlhf.data.io import DataValidationError
from rlhf.data.rollouts import complete_rollouts, read_rollout_table
from rlhf.models.load import load_options, load_tokenizer


def offline_table(cfg: PPOConfig, tokenizer) -> Optional[pd.DataFrame]:
    """The stored rollouts of `data.rollout_files` (`load_rollouts`), or None (online RLHF)."""
    return load_rollouts(cfg, tokenizer) if cfg.data.rollout_files else None


def load_rollouts(cfg: PPOConfig, tokenizer) -> pd.DataFrame:
    """The stored table at `data.rollout_files`, completed (`RolloutSchema` columns, plus
    `score` where stored) and checked to hold at least one round's block."""
    d = cfg.data
    stored = read_rollout_table(d.rollout_files, d.base_dir)
    prompt_ids = None if "prompt_ids" in stored else stages.tokenize(stored, tokenizer, cfg)
    table = complete_rollouts(stored, tokenizer, d.max_prompt_length, d.max_response_length, cfg.rollout.n,
                              prompt_ids, source=d.rollout_files)
    need = derive_sizes(cfg, 1).responses_per_round
    if len(table) < need:
        raise DataValidationError(
            f"{d.rollout_files}: {len(table)} stored responses, but a round needs {need} (trainer.steps_per_round "
            f"x data.train_batch_size x rollout.n); lower data.train_batch_size or store more rollouts")
    return table


def round_block(table: pd.DataFrame, cfg: PPOConfig, round_: int) -> pd.DataFrame:
    """Round `round_`'s (0-based) consecutive block of rows, in table order."""
    need = derive_sizes(cfg, 1).responses_per_round
    b = round_ % (len(table) // need)
    return table.iloc[b * need:(b + 1) * need].reset_index(drop=True)


def score_missing(rows: pd.DataFrame, cfg: PPOConfig, reward_model=None) -> pd.DataFrame:
    """`rows` with a `score` for every row: stored scores kept, the others computed."""
    stored = rows["score"] if "score" in rows else pd.Series(float("nan"), index=rows.index)
    if stored.notna().all():
        return rows.assign(score=stored.astype(float))
    computed = stages.score(rows.drop(columns="score", errors="ignore"), cfg, reward_model)["score"]
    return rows.assign(score=stored.where(stored.notna(), computed).astype(float))


def offline_round(table: pd.DataFrame, cfg: PPOConfig, round_: int, rank: int = 0, world: int = 1,
                  reward_model=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rollouts, scored): this rank's share of round `round_`'s block, as the rollout and
    score stages would hand them on (`RolloutSchema`, `ScoredRolloutSchema`)."""
    rows = stages.shard(round_block(table, cfg, round_), cfg.trainer.steps_per_round, rank, world)
    scored = score_missing(rows, cfg, reward_model)
    return scored.drop(columns="score"), scored


def offline_rollouts(cfg: PPOConfig, model_dir: str, round_: int, reward_model=None) -> pd.DataFrame:
    """The stateless driver's stage: round `round_`'s scored block, with the tokenizer saved
    in `model_dir` (the policy's)."""
    tokenizer = load_tokenizer(model_dir, **load_options(cfg.model))
    table = load_rollouts(cfg, tokenizer)
    return offline_round(table, cfg, round_, reward_model=reward_model)[1]
