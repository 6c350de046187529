"""Checks of a built config beyond the types of its values.

`validate` (run by every load, beside the range check of `rlhf.config.ranges` and the
rollout-correction check of `rlhf.config.correction`) refuses values no run can use:
unknown choices and loggers, non-positive sizes and URIs that carry a password.
`GROUP_ESTIMATORS` are the advantage estimators that need a group of responses per prompt.
"""

from __future__ import annotations

from typing import Any

from rlhf.config.redact import URI_PASSWORD, redact
from rlhf.config.schema import _CHOICES, _LOGGERS, ConfigError, PPOConfig, flatten


def validate(cfg: PPOConfig) -> None:
    flat = flatten(cfg)
    _refuse_credentials(flat)
    for key, choices in _CHOICES.items():
        if flat[key] not in choices:
            raise ConfigError(f"config key '{key}' is {flat[key]!r}; choose one of "
                              f"{', '.join('null' if c is None else c for c in choices)}")
    for name in cfg.trainer.logger:
        if name not in _LOGGERS:
            raise ConfigError(f"trainer.logger entry {name!r} is unknown; choose from {', '.join(_LOGGERS)}")
    positive = [
        "data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
        "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size_per_gpu", "actor.ppo_epochs",
        "actor.ppo_max_token_len_per_gpu", "rollout.n", "trainer.total_rounds",
        "trainer.steps_per_round", "trainer.n_gpus_per_node", "trainer.nnodes",
        "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_epochs", "rollout.generate_batch_size",
        "trainer.rounds_per_segment",
    ]
    for key in positive:
        if flat[key] <= 0:
            raise ConfigError(f"config key '{key}' must be > 0, got {flat[key]}")
    if not cfg.trainer.resume.strip():
        raise ConfigError("trainer.resume is empty; give auto, disable, or the checkpoint directory to start from")
    if not 0 < cfg.actor.clip_ratio < 1:
        raise ConfigError(f"actor.clip_ratio must be in (0, 1), got {cfg.actor.clip_ratio}")
    if cfg.actor.clip_ratio_c <= 1:
        raise ConfigError(f"actor.clip_ratio_c must be > 1 (dual-clip bound), got {cfg.actor.clip_ratio_c}")
    if cfg.algorithm.kl_ctrl.kl_coef < 0:
        raise ConfigError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {cfg.algorithm.kl_ctrl.kl_coef}")
    if cfg.deepspeed.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {cfg.deepspeed.zero_stage}")
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        raise ConfigError("rollout.gpu_memory_utilization must be in (0, 1]")
    for key in ("trainer.total_epochs", "rollout.log_prob_micro_batch_size_per_gpu",
                "ref.log_prob_micro_batch_size_per_gpu"):
        if flat[key] < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {flat[key]}")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs rollout.n >= 2 "
                          "(a group per prompt)")
    if cfg.trainer.test_freq <= 0 and cfg.trainer.test_freq != -1:
        raise ConfigError(f"trainer.test_freq must be > 0, or -1 for no validation; got {cfg.trainer.test_freq}")
    if cfg.trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup must be >= 0, got {cfg.trainer.critic_warmup}")
    if cfg.data.val_batch_size < 0 or cfg.rollout.val_temperature < 0:
        raise ConfigError("data.val_batch_size and rollout.val_temperature must be >= 0")


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # advantages from a prompt's group


def _refuse_credentials(flat: dict[str, Any]) -> None:
    """The config travels with the run (Flyte inputs and decks, MLflow params, checkpoints), so a
    URI in it may not carry a password; credentials come from the environment or Flyte Secrets."""
    for key, values in flat.items():
        for value in values if isinstance(values, list) else [values]:
            _refuse_password(key, value)


def _refuse_password(key: str, value: Any) -> None:
    if isinstance(value, str) and URI_PASSWORD.search(value):
        raise ConfigError(
            f"config key '{key}' holds a password in its URI ({redact(value)}); the config is stored with the "
            "run (Flyte inputs, MLflow params, checkpoints), so remove it and pass credentials through the "
            "environment or a Flyte Secret: MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or "
            "MLFLOW_TRACKING_TOKEN for MLflow, the storage's own variables (e.g. AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY) for data and models")
