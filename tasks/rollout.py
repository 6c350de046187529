"""Generation and reward tasks: rollout (GPU, HF or vLLM engine) and score."""

from __future__ import annotations

from flytekit import task
from flytekit.types.directory import FlyteDirectory

from containers.images import CPU_IMAGE, GPU_IMAGE
from rlhf.train import stateless as P
from rlhf.config.schema import PPOConfig
from rlhf.round.state import RoundState
from tasks.base import (CPU_MEDIUM, GPU, GPU_RETRIES, Prompts, Rolled, Rollouts, ScoredRound, gpu_resources,
                        local_policy, retry_transient)


@task(requests=gpu_resources(1), limits=gpu_resources(1), accelerator=GPU, shared_memory=True,
      interruptible=True, retries=GPU_RETRIES, container_image=GPU_IMAGE)
def rollout(cfg: PPOConfig, policy: FlyteDirectory, prompts: Prompts, state: RoundState) -> Rolled:
    """`rollout.n` responses per prompt from `policy`, sampled with the round's seed by the
    `rollout.name` engine (vLLM: tensor parallel over `rollout.tensor_model_parallel_size` GPUs),
    and the generation's seconds (`timing_s/gen`, for the update's step metrics)."""
    with retry_transient():
        rollouts, metrics = P.rollout_policy(cfg, local_policy(policy), prompts, state)
    return Rolled(rollouts=rollouts, timing=P.gen_timing(metrics))


@task(requests=CPU_MEDIUM, container_image=CPU_IMAGE, retries=2)
def score(cfg: PPOConfig, rollouts: Rollouts, timing: dict[str, float]) -> ScoredRound:
    """Each response's reward from the rule for its `data_source` (CPU); the round's stage
    `timing` with the scoring's (`timing_s/reward`) added."""
    with retry_transient():
        return ScoredRound(*P.score_timed(cfg, rollouts, timing))


@task(requests=gpu_resources(1), limits=gpu_resources(1), accelerator=GPU, interruptible=True, retries=GPU_RETRIES,
      container_image=GPU_IMAGE)
def score_with_model(cfg: PPOConfig, rollouts: Rollouts, timing: dict[str, float]) -> ScoredRound:
    """Each response's reward, rows with `reward_style` "model" from the reward model at
    `reward.model_path` (on a GPU, in the GPU image that has the model's dependencies); the
    timing as `score`'s."""
    with retry_transient():
        return ScoredRound(*P.score_timed(cfg, rollouts, timing))


def score_task(cfg: PPOConfig):
    """`score_with_model` when a reward model is configured, else the CPU `score`."""
    return score_with_model if cfg.reward.model_path else score
