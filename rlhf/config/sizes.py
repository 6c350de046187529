"""Sizes derived from the batch settings: per-GPU batches and the rounds of an epoch budget.

`derive_sizes` is the one function that turns batch settings into per-GPU sizes and
checks that they divide, suggesting a divisor when they do not. `rounds_for_epochs` and
`resolve_epochs` turn `trainer.total_epochs` into rounds once the train set's size is known.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rlhf.config.schema import ConfigError, PPOConfig


def rounds_for_epochs(cfg: PPOConfig, n_train: int) -> int:
    """Rounds that make verl's `trainer.total_epochs` over `n_train` train prompts. verl's
    loader drops each epoch's last partial batch, so an epoch is floor(n_train / train_batch_size)
    steps and the run epochs times that (`trainer_base.py`: `steps_per_epoch * total_epochs`);
    rounds = ceil(steps / steps_per_round). A train set smaller than one batch is refused, as
    verl refuses an empty loader."""
    bsz = cfg.data.train_batch_size
    if n_train < bsz:
        raise ConfigError(f"trainer.total_epochs needs at least one full batch of train prompts: the train set has "
                          f"{n_train} rows, data.train_batch_size is {bsz}; check data.train_files or lower "
                          "data.train_batch_size")
    steps = (n_train // bsz) * cfg.trainer.total_epochs
    return max(1, math.ceil(steps / cfg.trainer.steps_per_round))


def resolve_epochs(cfg: PPOConfig, n_train: int) -> PPOConfig:
    """`cfg` itself, or (with `trainer.total_epochs` > 0) a new config whose `trainer.total_rounds`
    makes that many epochs of the `n_train` train prompts (verl's count) and whose `total_epochs` is 0, so
    resolving again changes nothing. Called where the train set is prepared."""
    if cfg.trainer.total_epochs <= 0:
        return cfg
    rounds = rounds_for_epochs(cfg, n_train)
    trainer = dataclasses.replace(cfg.trainer, total_rounds=rounds, total_epochs=0)
    return dataclasses.replace(cfg, trainer=trainer)


@dataclass(frozen=True)
class Sizes:
    """Batch sizes derived from the config for a given world size."""

    world_size: int
    prompts_per_step: int  # data.train_batch_size
    responses_per_step: int  # prompts_per_step * rollout.n
    prompts_per_round: int  # steps_per_round * train_batch_size
    responses_per_round: int
    num_mini_batches: int  # per PPO epoch, per step
    mini_batch_responses: int  # global responses per optimizer step
    mini_batch_per_gpu: int  # responses per optimizer step on one rank
    micro_batch_per_gpu: int  # responses per forward/backward (fixed bsz)
    grad_accum_steps: int  # micro-batches per optimizer step (fixed bsz)
    responses_per_gpu: int  # responses of one step handled by one rank


def derive_sizes(cfg: PPOConfig, world_size: int | None = None) -> Sizes:
    """The one place batch sizes are derived; every divisibility rule is checked here."""
    ws = world_size if world_size is not None else cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if ws <= 0:
        raise ConfigError(f"world size must be > 0, got {ws}")
    bsz, n = cfg.data.train_batch_size, cfg.rollout.n
    mini = cfg.actor.ppo_mini_batch_size
    if mini > bsz or bsz % mini:
        raise ConfigError(
            f"actor.ppo_mini_batch_size ({mini}) must divide data.train_batch_size ({bsz}); "
            f"try a divisor such as {_divisor_near(bsz, mini)}")
    mini_resp = mini * n
    if mini_resp % ws:
        raise ConfigError(
            f"actor.ppo_mini_batch_size * rollout.n ({mini} * {n} = {mini_resp}) must be divisible by the "
            f"number of GPUs ({ws}); change actor.ppo_mini_batch_size or trainer.n_gpus_per_node")
    mini_per_gpu = mini_resp // ws
    micro = cfg.actor.ppo_micro_batch_size_per_gpu
    if not cfg.actor.use_dynamic_bsz:
        if micro > mini_per_gpu:
            micro = mini_per_gpu  # one micro-batch holds the whole per-GPU mini-batch
        if mini_per_gpu % micro:
            raise ConfigError(
                f"actor.ppo_micro_batch_size_per_gpu ({micro}) must divide the per-GPU mini-batch "
                f"(ppo_mini_batch_size * rollout.n / n_gpus = {mini_per_gpu}); "
                f"try {_divisor_near(mini_per_gpu, micro)}")
    min_tokens = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu < min_tokens:
        raise ConfigError(
            f"actor.ppo_max_token_len_per_gpu ({cfg.actor.ppo_max_token_len_per_gpu}) must hold one full "
            f"sequence (max_prompt_length + max_response_length = {min_tokens}); raise it")
    return Sizes(
        world_size=ws,
        prompts_per_step=bsz,
        responses_per_step=bsz * n,
        prompts_per_round=bsz * cfg.trainer.steps_per_round,
        responses_per_round=bsz * n * cfg.trainer.steps_per_round,
        num_mini_batches=bsz // mini,
        mini_batch_responses=mini_resp,
        mini_batch_per_gpu=mini_per_gpu,
        micro_batch_per_gpu=micro,
        grad_accum_steps=mini_per_gpu // micro if not cfg.actor.use_dynamic_bsz else 0,
        responses_per_gpu=bsz * n // ws,
    )


def _divisor_near(total: int, want: int) -> int:
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), -d))
