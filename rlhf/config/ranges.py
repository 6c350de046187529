"""The range of every numeric config key, checked where the config is read.

A value no run can use (a negative learning rate, an infinite KL coefficient, a top-p
of 2) is refused by `load_config` with the key, the value and the valid range, instead
of failing later inside torch or DeepSpeed, or training on while every step is skipped.

A range is written as intervals joined by `|`: `[0, inf)`, `(0, 1]`, `-1 | [1, inf)`.
A float key accepts infinity only where its range closes on `inf` (`(0, inf]`).
`repeated_keys` finds a key given twice among the command-line overrides.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

from rlhf.config.comments import key_rows
from rlhf.config.schema import ConfigError, PPOConfig

_ANY = "(-inf, inf)"
_POS = "[1, inf)"  # counts and sizes
_NONNEG = "[0, inf)"

RANGES: dict[str, str] = {
    "data.synthetic.n_sft": _NONNEG, "data.synthetic.n_train": _POS, "data.synthetic.n_val": _POS,
    "data.synthetic.digits": "[1, 18]", "data.synthetic.n_steps": _POS, "data.synthetic.seed": _NONNEG,
    "data.train_batch_size": _POS, "data.val_batch_size": _NONNEG, "data.max_prompt_length": _POS,
    "data.max_response_length": _POS,
    "model.tiny.hidden_size": _POS, "model.tiny.num_hidden_layers": _POS, "model.tiny.num_attention_heads": _POS,
    "model.tiny.num_key_value_heads": _POS, "model.tiny.intermediate_size": _POS,
    "model.tiny.max_position_embeddings": _POS,
    "model.sft.max_seconds": "(0, inf]", "model.sft.epochs": _POS, "model.sft.max_steps": _NONNEG,
    "model.sft.batch_size": _POS, "model.sft.lr": "(0, inf)", "model.sft.min_lr_ratio": "[0, 1]",
    "model.sft.warmup_steps": _NONNEG, "model.sft.weight_decay": _NONNEG, "model.sft.grad_clip": _NONNEG,
    "model.sft.log_every": _POS, "model.sft.num_threads": _NONNEG, "model.sft.stop_at_accuracy": "[0, 1]",
    "model.sft.probe_size": _NONNEG, "model.sft.probe_every": _POS,
    "actor.lr": _NONNEG, "actor.weight_decay": _NONNEG, "actor.ppo_epochs": _POS,
    "actor.ppo_mini_batch_size": _POS, "actor.ppo_micro_batch_size_per_gpu": _POS,
    "actor.ppo_max_token_len_per_gpu": _POS, "actor.clip_ratio": "(0, 1)", "actor.clip_ratio_low": "(0, 1)",
    "actor.clip_ratio_high": "(0, inf)", "actor.clip_ratio_c": "(1, inf)", "actor.entropy_coeff": _ANY,
    "actor.grad_clip": _NONNEG, "actor.kl_loss_coef": _NONNEG, "actor.tis_imp_ratio_cap": "-1 | (0, inf)",
    "model.lora_rank": _NONNEG, "model.lora_alpha": "(0, inf)", "critic.lora_rank": _NONNEG,
    "critic.lora_alpha": "(0, inf)",
    "critic.lr": _NONNEG, "critic.weight_decay": _NONNEG, "critic.ppo_epochs": _POS,
    "critic.cliprange_value": "(0, inf)", "critic.grad_clip": _NONNEG, "critic.ppo_micro_batch_size_per_gpu": _POS,
    "rollout.n": _POS, "rollout.temperature": "(0, inf)", "rollout.top_p": "(0, 1]", "rollout.top_k": "-1 | [1, inf)",
    "rollout.tensor_model_parallel_size": _POS, "rollout.gpu_memory_utilization": "(0, 1]",
    "rollout.max_num_batched_tokens": _POS, "rollout.max_num_seqs": _POS,
    "rollout.log_prob_micro_batch_size_per_gpu": _NONNEG,
    "ref.log_prob_micro_batch_size_per_gpu": _NONNEG, "rollout.generate_batch_size": _POS, "rollout.val_temperature": _NONNEG,
    "algorithm.gamma": "[0, 1]", "algorithm.lam": "[0, 1]",
    "algorithm.kl_ctrl.kl_coef": _NONNEG, "algorithm.kl_ctrl.target_kl": "(0, inf)",
    "algorithm.kl_ctrl.horizon": _POS,
    # algorithm.rollout_correction's thresholds are strings (verl's 'lower_upper'): rlhf.config.correction checks them.
    "reward.format_score": _ANY, "reward.score": _ANY, "reward.model_batch_size": _POS,
    "trainer.total_rounds": _POS, "trainer.total_epochs": _NONNEG, "trainer.steps_per_round": _POS,
    "trainer.test_freq": "-1 | [1, inf)", "trainer.critic_warmup": _NONNEG,
    "trainer.seed": _NONNEG, "trainer.n_gpus_per_node": _POS, "trainer.nnodes": _POS,
    "trainer.num_threads": _NONNEG, "trainer.profile_steps": _POS, "trainer.max_ckpt_to_keep": _ANY,
    "trainer.save_freq": "-1 | [1, inf)", "trainer.rounds_per_segment": _POS,
    "deepspeed.zero_stage": "[0, 3]",
    "early_stop.kl_patience": _POS, "early_stop.kl_ceiling": "(0, inf]", "early_stop.val_patience": _NONNEG,
    "early_stop.min_delta": _NONNEG, "early_stop.max_nonfinite_steps": _POS,
}

_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^\])\s]+)\s*([\])])$")


def _in_part(x: float, part: str) -> bool:
    """Whether `x` lies in one part of a range: an interval or a single value."""
    m = _INTERVAL.match(part.strip())
    if m is None:
        return x == float(part)
    lo_closed, lo, hi, hi_closed = m.group(1) == "[", float(m.group(2)), float(m.group(3)), m.group(4) == "]"
    above = x >= lo if lo_closed else x > lo
    below = x <= hi if hi_closed else x < hi
    return above and below


def in_range(x: float, spec: str) -> bool:
    """Whether the number `x` is in `spec` (see the module docstring); NaN never is."""
    return not math.isnan(x) and any(_in_part(x, part) for part in spec.split("|"))


def _numbers(value: Any) -> Iterable[float]:
    """The numbers a config value holds: itself, or each list entry; None holds none."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [float(v) for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]


def check_ranges(flat: dict[str, Any]) -> None:
    """Raise `ConfigError` for the first key of `flat` (dotted key -> value) whose number lies
    outside its range in `RANGES`, naming the key, the value, the range and what the key is."""
    for key, spec in RANGES.items():
        for x in _numbers(flat.get(key)):
            if not in_range(x, spec):
                note = _note(key)
                what = f" ({note})" if note else ""
                raise ConfigError(f"config key '{key}' is {_shown(x)}; it must be in {spec.replace(' | ', ' or ')}{what}. "
                                  f"Give a value in that range")


def _note(key: str) -> str:
    """The comment beside the key's field (as docs/CONFIG.md shows it)."""
    return next((note for k, _, _, note in key_rows(PPOConfig) if k == key), "")


def _shown(x: float) -> str:
    if math.isinf(x):
        return "infinite" if x > 0 else "-infinite"
    return repr(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)


def numeric_keys() -> list[str]:
    """Every key of `PPOConfig` whose type holds an int or a float (optional and list types included)."""
    return [key for key, tp, _, _ in key_rows(PPOConfig) if re.search(r"\b(int|float)\b", tp)]


def repeated_keys(overrides: Iterable[str]) -> list[tuple[str, list[str]]]:
    """(key, the values given in order) for each dotted key set more than once in `overrides`."""
    seen: dict[str, list[str]] = {}
    for text in overrides:
        if "=" in text:
            key, raw = text.split("=", 1)
            seen.setdefault(key.strip().lstrip("+"), []).append(raw)
    return [(k, v) for k, v in seen.items() if len(v) > 1]


def warn_repeated(overrides: Iterable[str]) -> None:
    """Warn once for each key the overrides set more than once (the last value wins)."""
    import warnings

    for key, values in repeated_keys(overrides):
        warnings.warn(f"config key '{key}' is given {len(values)} times on the command line "
                      f"({', '.join(values)}); the last one ({values[-1]}) is used. Give each key once",
                      UserWarning, stacklevel=3)
