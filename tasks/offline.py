"""Offline RLHF tasks: the stored rollout table in place of rollout + score."""

from __future__ import annotations

from flytekit import task
from flytekit.types.directory import FlyteDirectory

from containers.images import CPU_IMAGE
from rlhf.train import setup as S
from rlhf.round import stages
from rlhf.config.load import replace
from rlhf.config.schema import ConfigError, PPOConfig
from rlhf.round.offline import offline_rollouts
from rlhf.round.state import RoundState
from rlhf.train.step import timer
from tasks.base import CPU_MEDIUM, CPU_SMALL, ScoredRound, retry_transient


@task(requests=CPU_MEDIUM, container_image=CPU_IMAGE, retries=2)
def offline_rollout(cfg: PPOConfig, policy: FlyteDirectory, state: RoundState) -> ScoredRound:
    """Round `state.round`'s block of the stored rollouts (`data.rollout_files`), scored where
    the table has no score; `policy` gives the tokenizer for rows stored as text only. Its
    seconds are the round's `timing_s/reward` (no generation: `timing_s/gen` 0)."""
    timing = {"timing_s/gen": 0.0}
    with retry_transient(), timer(timing, "timing_s/reward"):
        reward_model = stages.load_reward_model(cfg, S.pick_device(cfg))
        scored = offline_rollouts(cfg, policy.download(), state.round, reward_model)
    return ScoredRound(scored=scored, timing=timing)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE)
def offline_config(cfg: PPOConfig, rollout_files: str) -> PPOConfig:
    """`cfg` with `data.rollout_files` set to `rollout_files` (when given); one of them must name
    the stored rollouts."""
    out = replace(cfg, [f"data.rollout_files={rollout_files}"]) if rollout_files else cfg
    if not out.data.rollout_files:
        raise ConfigError("ppo_offline needs stored rollouts: pass --rollout_files PATH or set data.rollout_files")
    return out
