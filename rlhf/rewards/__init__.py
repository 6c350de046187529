"""Rewards, chosen per row by `data_source` (verl's convention).

A rule reward is a plain function `reward(response, ground_truth, extra_info, cfg) ->
float` living in its own module and registered under the data sources it scores.
Rows whose `reward_style` is "model" are scored by a `RewardModel` instead.

    from rlhf.rewards import REWARDS
    REWARDS.add("my/source", my_module.reward)   # add a source
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Sequence

from rlhf.config.schema import RewardConfig
from rlhf.config.registry import Registry
from rlhf.models.gguf import find_gguf
from rlhf.rewards import arithmetic, gsm8k
from rlhf.rewards.model import RewardModel

RewardFn = Callable[[str, str, dict, RewardConfig], float]

REWARDS: Registry[RewardFn] = Registry("reward function")
REWARDS.add("openai/gsm8k", gsm8k.reward)
REWARDS.add("synthetic/arithmetic", arithmetic.reward)

STYLES = ("rule", "model")


class RewardError(ValueError):
    """A row cannot be scored; the message names the row and what to change."""


def get_reward_fn(data_source: str) -> RewardFn:
    """The rule reward registered for `data_source`; unknown sources list the known ones."""
    if data_source not in REWARDS:
        raise RewardError(
            f"no reward function for data_source {data_source!r}; known: {', '.join(REWARDS.names())}. "
            f"Register one with rlhf.rewards.REWARDS.add({data_source!r}, fn)")
    return REWARDS.get(data_source)


def parse_extra_info(value: Any, row: int) -> dict:
    """`extra_info` as a dict: None -> {}, a JSON object string -> dict, a dict as is."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value == "":
        return {}
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError) as e:
        raise RewardError(f"row {row}: extra_info is not a JSON object string: {value!r} ({e})") from e
    if not isinstance(parsed, dict):
        raise RewardError(f"row {row}: extra_info must be a JSON object, got {value!r}")
    return parsed


def load_reward_model(cfg: RewardConfig, device: str = "cpu"):
    """A `RewardModel` for `cfg.model_path`, or None when no path is set."""
    if not cfg.model_path:
        return None
    if find_gguf(cfg.model_path):
        raise ValueError(f"reward.model_path '{cfg.model_path}' is a GGUF file; GGUF holds causal language models, "
                         "and a reward model is a sequence classifier with one output: save it with "
                         "save_pretrained (safetensors) and point reward.model_path at that directory")
    return RewardModel(cfg.model_path, batch_size=cfg.model_batch_size, device=device)


def compute_scores(
    data_sources: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[str | None],
    extra_infos: Sequence[Any],
    reward_styles: Sequence[str],
    cfg: RewardConfig,
    reward_model=None,
    prompts: Sequence[str] | None = None,
) -> list[float]:
    """One score per row: rule rows through their data_source's function, model rows
    through `reward_model.score(prompts, responses)` (which then needs `prompts`)."""
    n = len(responses)
    columns = {"data_sources": data_sources, "ground_truths": ground_truths,
               "extra_infos": extra_infos, "reward_styles": reward_styles}
    for name, col in columns.items():
        if len(col) != n:
            raise RewardError(f"compute_scores: {name} has {len(col)} rows but responses has {n}")
    scores = [0.0] * n
    model_rows = _rows_by_style(reward_styles)
    is_model = set(model_rows)
    for i in range(n):
        if i not in is_model:
            scores[i] = _rule_score(i, data_sources[i], responses[i], ground_truths[i], extra_infos[i], cfg)
    if model_rows:
        for i, s in zip(model_rows, _model_scores(model_rows, responses, prompts, reward_model)):
            scores[i] = s
    return scores


def _rows_by_style(reward_styles: Sequence[str]) -> list[int]:
    """Indices of "model" rows; an unknown style raises naming the row."""
    for i, style in enumerate(reward_styles):
        if style not in STYLES:
            raise RewardError(f"row {i}: reward_style {style!r} is unknown; choose one of {', '.join(STYLES)}")
    return [i for i, style in enumerate(reward_styles) if style == "model"]


def _rule_score(row: int, data_source: str, response: str, ground_truth: str | None, extra: Any,
                cfg: RewardConfig) -> float:
    fn = get_reward_fn(data_source)
    if ground_truth is None:
        raise RewardError(f"row {row}: reward_style 'rule' (data_source {data_source!r}) needs a ground_truth")
    return float(fn(response, ground_truth, parse_extra_info(extra, row), cfg))


def _model_scores(rows: list[int], responses: Sequence[str], prompts: Sequence[str] | None,
                  reward_model) -> list[float]:
    if reward_model is None:
        raise RewardError(
            f"{len(rows)} rows (first: row {rows[0]}) have reward_style 'model' but no reward model is "
            "configured; set reward.model_path to a local reward-model directory")
    if prompts is None or len(prompts) != len(responses):
        raise RewardError("rows with reward_style 'model' need the prompts: pass prompts= (one per response)")
    return reward_model.score([prompts[i] for i in rows], [responses[i] for i in rows])
