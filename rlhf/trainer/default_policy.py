"""The default policy when no model path is given: char tokenizer + tiny Llama + SFT warm-start."""

from __future__ import annotations

import json
import os

import pandas as pd

from rlhf.config.schema import PPOConfig
from rlhf.models.load import save_model_atomic
from rlhf.trainer.sft import sft_warm_start
from rlhf.models.tiny import build_tiny_model
from rlhf.models.tokenizer import build_char_tokenizer
from rlhf.data.arithmetic import solution_text

SFT_METRICS_FILE = "sft_metrics.json"


def build_tiny_policy(cfg: PPOConfig):
    """(model, tokenizer): a fresh tiny Llama seeded by `trainer.seed`, and the char tokenizer."""
    tok = build_char_tokenizer()
    model = build_tiny_model(cfg.model.tiny, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id,
                             seed=cfg.trainer.seed)
    return model, tok


def sft_targets(sft_df: pd.DataFrame) -> list[str]:
    """The answer text for each labeled row (GSM8K's "#### <answer>" format)."""
    missing = sft_df.index[sft_df["ground_truth"].isna()].tolist()
    if missing:
        raise ValueError(f"SFT rows {missing[:5]} have no ground_truth; the warm-start needs labeled rows")
    return [solution_text(str(g)) for g in sft_df["ground_truth"]]


def warm_start(cfg: PPOConfig, sft_df: pd.DataFrame, progress: bool = True):
    """(model, tokenizer, sft metrics): the tiny policy after SFT on `sft_df` (skipped if disabled)."""
    model, tok = build_tiny_policy(cfg)
    metrics: dict[str, float] = {}
    if cfg.model.sft.enable:
        metrics = sft_warm_start(model, tok, sft_df["prompt"].tolist(), sft_targets(sft_df), cfg.model.sft,
                                 seed=cfg.trainer.seed, progress=progress)
    return model, tok, metrics


def build_default_policy(cfg: PPOConfig, out_dir: str, sft_df: pd.DataFrame, progress: bool = True) -> str:
    """Build, warm-start and save (atomically) the default policy; returns `out_dir`.

    The SFT metrics are saved beside the weights as `sft_metrics.json`.
    """
    model, tok, metrics = warm_start(cfg, sft_df, progress)
    save_model_atomic(model, tok, out_dir)
    with open(os.path.join(out_dir, SFT_METRICS_FILE), "w", encoding="utf-8") as f:
        json.dump(metrics, f)
    return out_dir
