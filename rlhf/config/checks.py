"""Checks of a built config beyond the types of its values.

`validate` (run by every load, beside the range check of `rlhf.config.ranges`) refuses
values no run can use: unknown choices and loggers, non-positive sizes, conflicting
rollout-correction keys and URIs that carry a password. `correction_settings` is the
rollout correction in effect, a named preset (`ROLLOUT_CORRECTION_PRESETS`) applied.
`GROUP_ESTIMATORS` are the advantage estimators that need a group of responses per prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

from rlhf.config.redact import URI_PASSWORD, redact
from rlhf.config.schema import _CHOICES, _LOGGERS, ConfigError, PPOConfig, RolloutCorrectionConfig, flatten


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
    correction_settings(cfg)  # raises on a bad preset or conflicting keys



GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # advantages from a prompt's group

# verl's rollout-correction presets (`RolloutCorrectionConfig.<name>()`), decoupled mode unless
# bypass; verl's pg_is / pg_rs (policy-gradient loss without clipping) are not offered here.
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "disabled": dict(rollout_is=None),  # mismatch metrics only
    "decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0),
    "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0),
    "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="sequence",
                                rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5),
    "decoupled_geo_rs": dict(rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=1.001,
                             rollout_rs_threshold_lower=0.999, rollout_token_veto_threshold=1e-4),
    "ppo_is_bypass": dict(rollout_is=None, bypass_mode=True),
}


def correction_settings(cfg: PPOConfig) -> RolloutCorrectionConfig:
    """The rollout correction in effect: `algorithm.rollout_correction` with its `preset`
    applied, or token-level TIS at `actor.tis_imp_ratio_cap` when that is set. A preset
    or the cap together with changed fields raises (one source of truth per run)."""
    rc = cfg.algorithm.rollout_correction
    changed = {f.name for f in fields(rc) if f.name != "preset" and getattr(rc, f.name) != f.default}
    cap = cfg.actor.tis_imp_ratio_cap
    if cap != -1.0 and cap <= 0:
        raise ConfigError(f"actor.tis_imp_ratio_cap must be > 0, or -1 for off; got {cap}")
    if rc.preset:
        if rc.preset not in ROLLOUT_CORRECTION_PRESETS:
            raise ConfigError(f"algorithm.rollout_correction.preset {rc.preset!r} is unknown; choose one of "
                              f"{', '.join(ROLLOUT_CORRECTION_PRESETS)}")
        if changed or cap > 0:
            raise ConfigError(f"algorithm.rollout_correction.preset={rc.preset} sets the correction; remove "
                              f"{', '.join(sorted(changed)) or 'actor.tis_imp_ratio_cap'} or the preset")
        rc = dataclasses.replace(RolloutCorrectionConfig(), **ROLLOUT_CORRECTION_PRESETS[rc.preset])
    elif cap > 0:
        if changed:
            raise ConfigError(f"actor.tis_imp_ratio_cap is verl's older spelling of rollout_is=token with "
                              f"rollout_is_threshold=cap; remove it or algorithm.rollout_correction."
                              f"{', algorithm.rollout_correction.'.join(sorted(changed))}")
        rc = dataclasses.replace(rc, rollout_is="token", rollout_is_threshold=cap)
    elif rc.rollout_is_threshold <= 0:
        raise ConfigError(f"algorithm.rollout_correction.rollout_is_threshold must be > 0, got "
                          f"{rc.rollout_is_threshold}")
    _check_rejection_bounds(rc)
    return rc


def _check_rejection_bounds(rc: RolloutCorrectionConfig) -> None:
    """Rejection keeps ratios in [lower, upper], which needs lower <= upper: refused at launch
    rather than by the trainer's first update (non-positive bounds are left to the range
    check, which names the key)."""
    if rc.rollout_rs is None:
        return
    upper = rc.rollout_rs_threshold if rc.rollout_rs_threshold is not None else rc.rollout_is_threshold
    if not upper > 0 or (rc.rollout_rs_threshold_lower is not None and not rc.rollout_rs_threshold_lower > 0):
        return
    lower = rc.rollout_rs_threshold_lower if rc.rollout_rs_threshold_lower is not None else 1.0 / upper
    if lower > upper:
        raise ConfigError(f"algorithm.rollout_correction rejects ratios outside [lower, upper], but lower={lower:g} "
                          f"is above upper={upper:g} (rollout_rs_threshold, else rollout_is_threshold; "
                          f"rollout_rs_threshold_lower, else 1 / upper). Give rollout_rs_threshold_lower <= rollout_rs_threshold")


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
