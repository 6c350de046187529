"""Validation: one response per prompt, greedy (`rollout.val_temperature=0`, the default) or
sampled at that temperature, `data.val_batch_size` prompts per generate call (0: all), scored
by the reward rules; `evaluate` runs it as a run's config sets it.

Metrics (verl's names): `val-core/<data_source>/reward/mean@1` per source, and overall
`val/reward/mean`, `val/accuracy` (share of responses given the full `reward.score`),
`val/response_length/mean` (tokens), `val/n`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from rlhf.config.schema import PPOConfig, RewardConfig
from rlhf.rollout.base import RolloutEngine, SamplingParams
from rlhf.data.sampling import tokenize_prompts
from rlhf.rewards import compute_scores
from rlhf.trainer.faults import oom_as_recoverable, rollout_memory_settings


def greedy_texts(engine: RolloutEngine, prompt_ids: list[list[int]], max_response_length: int,
                 batch_size: int = 0, temperature: float = 0.0, seed: int | None = None
                 ) -> tuple[list[str], list[int]]:
    """(response texts, response lengths in tokens), one response per prompt, in order: greedy at
    `temperature` 0, else sampled (seeded); `batch_size` prompts per generate call (0: all)."""
    step = batch_size if batch_size > 0 else max(1, len(prompt_ids))
    params = SamplingParams(n=1, temperature=temperature, max_tokens=max_response_length,
                            seed=seed if temperature > 0 else None)
    texts: list[str] = []
    lengths: list[int] = []
    for i in range(0, len(prompt_ids), step):
        batch = engine.generate(prompt_ids[i:i + step], params)
        texts += list(batch.response_text)
        lengths += [len(r) for r in batch.response_ids]
    return texts, lengths


def score_metrics(data_sources: list[str], scores: list[float], lengths: list[int], full_score: float
                  ) -> dict[str, float]:
    """Flat metrics from per-response scores; pure."""
    s = np.asarray(scores, dtype=np.float64)
    src = np.asarray(data_sources, dtype=object)
    metrics = {f"val-core/{name}/reward/mean@1": float(s[src == name].mean()) for name in sorted(set(data_sources))}
    metrics["val/reward/mean"] = float(s.mean())
    metrics["val/accuracy"] = float((s >= full_score).mean())
    metrics["val/response_length/mean"] = float(np.mean(lengths))
    metrics["val/n"] = float(len(s))
    return metrics


def evaluate_greedy(engine: RolloutEngine, tokenizer, df: pd.DataFrame, max_prompt_length: int,
                    max_response_length: int, reward_cfg: RewardConfig, reward_model=None,
                    prompt_format: str = "text", truncation: str = "error", batch_size: int = 0,
                    temperature: float = 0.0, seed: int | None = None, samples: list | None = None,
                    n_samples: int = 8) -> dict[str, float]:
    """Decode every prompt of `df` (PromptSchema columns) once (greedy unless `temperature` > 0,
    `batch_size` prompts at a time) and score it; returns flat metrics. With a `samples` list,
    its first `n_samples` rows are appended to it as dicts (data_source, prompt, response,
    ground_truth, score) for the run's generations table."""
    if len(df) == 0:
        raise ValueError("evaluate_greedy: the validation frame is empty; check data.val_files")
    prompt_ids = tokenize_prompts(df["prompt"].tolist(), tokenizer, max_prompt_length, truncation=truncation,
                                  prompt_format=prompt_format)
    texts, lengths = greedy_texts(engine, prompt_ids, max_response_length, batch_size, temperature, seed)
    scores = compute_scores(df["data_source"].tolist(), texts, df["ground_truth"].tolist(),
                            df["extra_info"].tolist(), df["reward_style"].tolist(), reward_cfg,
                            reward_model=reward_model, prompts=df["prompt"].tolist())
    if samples is not None:
        samples.extend(_samples(df, texts, scores, n_samples))
    return score_metrics(df["data_source"].tolist(), scores, lengths, reward_cfg.score)


def _samples(df: pd.DataFrame, texts: list[str], scores: list[float], n: int) -> list[dict]:
    head = df.head(n)
    return [{"data_source": str(src), "prompt": str(p), "response": t,
             "ground_truth": None if pd.isna(g) else str(g), "score": float(s)}
            for src, p, g, t, s in zip(head["data_source"], head["prompt"], head["ground_truth"], texts, scores)]


def evaluate(engine: RolloutEngine, tokenizer, val: pd.DataFrame, cfg: PPOConfig, reward_model=None,
             samples: list | None = None) -> dict[str, float]:
    """Validation (greedy unless `rollout.val_temperature` > 0, `data.val_batch_size` prompts per
    generate call): flat `val-core/<source>/reward/mean@1` metrics and `val/accuracy` (with a
    `samples` list, a few prompts, responses and scores are appended to it)."""
    with oom_as_recoverable("validation rollout", rollout_memory_settings(cfg)):
        return evaluate_greedy(engine, tokenizer, val, cfg.data.max_prompt_length, cfg.data.max_response_length,
                               cfg.reward, reward_model=reward_model, prompt_format=cfg.data.prompt_format,
                               truncation=cfg.data.truncation, batch_size=cfg.data.val_batch_size,
                               temperature=cfg.rollout.val_temperature, seed=cfg.trainer.seed, samples=samples)
