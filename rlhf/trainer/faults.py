"""Errors for faults a run can meet, each saying what to change.

- `RecoverableOOMError`: a device ran out of memory in a micro-batch of the update or in
  the rollout. A retry with the named settings lowered can work, so drivers may catch it,
  lower them and run again (from the last round checkpoint).
- `NonFiniteStateError`: the weights about to be checkpointed hold NaN or inf; the
  checkpoint is refused, so resuming always starts from a finite state.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch

log = logging.getLogger(__name__)


class RecoverableOOMError(RuntimeError):
    """Out of device memory in `stage`; `settings` maps the config keys to lower to their values."""

    def __init__(self, stage: str, settings: Mapping[str, object], cause: BaseException | None = None):
        self.stage = stage
        self.settings = dict(settings)
        names = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        detail = f" ({str(cause).splitlines()[0][:200]})" if cause is not None and str(cause) else ""
        super().__init__(f"out of device memory in the {stage}{detail}; lower one of: {names} "
                         "and run again: the run resumes from its last round checkpoint")


class NonFiniteStateError(RuntimeError):
    """Weights with NaN or inf values; names the first offending tensors."""


def update_memory_settings(cfg) -> dict[str, object]:
    """The settings that bound the update's peak memory, with their current values."""
    a = cfg.actor
    budget = a.ppo_max_token_len_per_gpu
    if not a.use_dynamic_bsz:
        budget = f"{budget} with actor.use_dynamic_bsz=true"
    out: dict[str, object] = {"actor.ppo_micro_batch_size_per_gpu": a.ppo_micro_batch_size_per_gpu,
                              "actor.ppo_max_token_len_per_gpu": budget}
    if cfg.algorithm.adv_estimator == "gae":
        out["critic.ppo_micro_batch_size_per_gpu"] = cfg.critic.ppo_micro_batch_size_per_gpu
    if not cfg.model.enable_gradient_checkpointing:
        out["model.enable_gradient_checkpointing"] = "false (set true)"
    return out


def rollout_memory_settings(cfg) -> dict[str, object]:
    """The settings that bound the rollout's peak memory, with their current values."""
    r = cfg.rollout
    if r.name == "vllm":
        return {"rollout.gpu_memory_utilization": r.gpu_memory_utilization,
                "rollout.max_num_batched_tokens": r.max_num_batched_tokens}
    return {"rollout.generate_batch_size": r.generate_batch_size,
            "rollout.gpu_memory_utilization": f"{r.gpu_memory_utilization} with rollout.name=vllm"}


@contextmanager
def oom_as_recoverable(stage: str, settings: Mapping[str, object]) -> Iterator[None]:
    """Turn `torch.OutOfMemoryError` raised inside into a `RecoverableOOMError` naming `settings`."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the caller may retry in this process with smaller batches
        err = RecoverableOOMError(stage, settings, e)
        log.error("%s", err)
        raise err from e


def non_finite_tensors(state_dicts: Mapping[str, Mapping[str, torch.Tensor] | None], limit: int = 5) -> list[str]:
    """Names ("actor/<param>") of up to `limit` floating tensors that hold NaN or inf."""
    bad = []
    for prefix, sd in state_dicts.items():
        for name, t in (sd or {}).items():
            if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(f"{prefix}/{name}")
                if len(bad) >= limit:
                    return bad
    return bad
