"""Reward for the synthetic arithmetic task (`synthetic/arithmetic`).

Its answers use GSM8K's format (`#### 68`), so it shares GSM8K's rule: the same
extraction, the same `score` / `format_score` / 0 outcomes.
"""

from __future__ import annotations

from rlhf.rewards.gsm8k import compute_score as _gsm8k_score


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the final `#### <number>` equals `ground_truth`, `format_score` if wrong, 0 if none."""
    return _gsm8k_score(solution_str, ground_truth, method=method, format_score=format_score, score=score)


def reward(response: str, ground_truth: str, extra_info: dict, cfg) -> float:
    """Registry entry: the rule with `cfg.gsm8k_method`, `cfg.format_score`, `cfg.score` (a RewardConfig)."""
    return compute_score(response, ground_truth, cfg.gsm8k_method, cfg.format_score, cfg.score)
