"""Checks of real data against the model and the batch settings, before a round runs.

- `check_position_limit`: prompt plus response tokens (`data.max_prompt_length +
  data.max_response_length`) must fit in the policy's position limit
  (`max_position_embeddings`); a longer sequence would run past the position table.
- `resampling_factor` / `warn_resampling`: a train set smaller than a round's draw
  (`steps_per_round * train_batch_size`) repeats every prompt several times a round.
- `labeled_rows`: the rows of a user dataset that can warm-start the tiny default model
  (rule-scored rows with a ground truth: the SFT target is `#### <ground truth>`).
"""

from __future__ import annotations

import json
import logging
import os

import pandas as pd

from rlhf.config.schema import ConfigError, PPOConfig

log = logging.getLogger(__name__)


def position_limit(cfg: PPOConfig, model_dir: str = "") -> tuple[int, str]:
    """(the policy's position limit, where it comes from): `max_position_embeddings` of the
    model's config.json, or of `model.tiny` for the default model; (0, "") when unknown."""
    if not cfg.model.path:
        return cfg.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    path = os.path.join(model_dir or cfg.model.path.removeprefix("file://"), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return 0, ""
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(text.get(key), int) and text[key] > 0:
            return int(text[key]), f"{key} in {path}"
    return 0, ""


def check_position_limit(cfg: PPOConfig, model_dir: str = "") -> None:
    """Raise `ConfigError` when a full sequence cannot fit in the policy's position limit."""
    limit, where = position_limit(cfg, model_dir)
    d = cfg.data
    need = d.max_prompt_length + d.max_response_length
    if limit and need > limit:
        fix = ("raise model.tiny.max_position_embeddings" if not cfg.model.path else "use a model with a longer "
               "context")
        raise ConfigError(
            f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + {d.max_response_length} "
            f"= {need} tokens, more than the policy's position limit of {limit} ({where}); lower "
            f"data.max_prompt_length or data.max_response_length so that they add up to at most {limit}, or {fix}")


def resampling_factor(n_rows: int, cfg: PPOConfig) -> float:
    """How many times a round draws each train prompt on average (0 for an empty table)."""
    per_round = cfg.trainer.steps_per_round * cfg.data.train_batch_size
    return per_round / n_rows if n_rows else 0.0


def resampling_message(n_rows: int, cfg: PPOConfig) -> str:
    """A warning when a round draws every train prompt more than once, else ""."""
    factor = resampling_factor(n_rows, cfg)
    if factor <= 1:
        return ""
    per_round = cfg.trainer.steps_per_round * cfg.data.train_batch_size
    return (f"the train set has {n_rows} prompts but a round draws {per_round} (trainer.steps_per_round * "
            f"data.train_batch_size), so each prompt is used about {factor:.1f} times a round; give more "
            f"train rows or lower data.train_batch_size to at most {n_rows}")


def warn_resampling(n_rows: int, cfg: PPOConfig) -> str:
    """Log `resampling_message` as a warning when there is one; returns it."""
    message = resampling_message(n_rows, cfg)
    if message:
        log.warning(message)
    return message


def labeled_rows(train: pd.DataFrame) -> pd.DataFrame:
    """The rule-scored train rows with a ground truth, as SFT examples for the tiny model."""
    labeled = train[(train["reward_style"] == "rule") & train["ground_truth"].notna()
                    & (train["ground_truth"].astype(str).str.strip() != "")]
    return labeled.reset_index(drop=True)


def user_sft_split(train: pd.DataFrame, limit: int) -> pd.DataFrame:
    """Up to `limit` labeled rows of a user train set for the tiny model's warm-start; raises
    `ValueError` with the fix when the set has none."""
    labeled = labeled_rows(train)
    if labeled.empty:
        raise ValueError(
            "the default tiny model is warm-started on labeled rows, and the train set has none (no "
            "rule-scored row with a ground_truth); add ground truths to data.train_files, or set model.path "
            "to a model of your own")
    return labeled.head(limit) if limit > 0 else labeled


def check_fit(cfg: PPOConfig, n_train: int, model_dir: str = "") -> None:
    """The checks a driver runs once the data and the policy are known: position limit, resampling."""
    check_position_limit(cfg, model_dir)
    warn_resampling(n_train, cfg)
