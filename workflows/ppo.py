"""The PPO pipeline: prepare data and the starting policy, then rounds until `total_rounds`
or an early stop, then the report.

    pyflyte run workflows/ppo.py ppo_pipeline                 # embedded default, CPU
    pyflyte run workflows/ppo.py ppo_pipeline --cfg my.yaml   # any PPOConfig as YAML/JSON

One round, as in `rlhf.train` (the in-process driver of the same stages):

    sample_prompts -> rollout -> score -> ppo_update -> [evaluate] -> decide -> next round | finish
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import pandas as pd
from flytekit import conditional, dynamic, workflow
from flytekit.types.directory import FlyteDirectory

from containers.images import CPU_IMAGE
from rlhf import pipeline as P
from rlhf.config import PPOConfig
from rlhf.state import RoundState
from sweeps.trial import TrialContext
from tasks.base import CPU_SMALL, Prompts, gpu_resources
from tasks.data import dataset_fingerprint, fit_prompts, prepare_dataset, prepare_policy, sample_prompts
from tasks.evaluate import decide, evaluate
from tasks.offline import offline_config, offline_rollout
from tasks.rollout import rollout, score
from tasks.run import check_config, finish, report, start_tracking
from tasks.update import elastic_for, update_task

Rounds = NamedTuple("Rounds", [("model", FlyteDirectory), ("state", RoundState)])
Trained = NamedTuple("Trained", [("model", FlyteDirectory), ("metrics", pd.DataFrame), ("state", RoundState),
                                 ("run_id", str)])
Pipeline = NamedTuple("Pipeline", [("model", FlyteDirectory), ("metrics", pd.DataFrame), ("state", RoundState)])
Data = NamedTuple("Data", [("train", Prompts), ("val", Prompts), ("sft", Prompts)])


@workflow
def prepare_data(cfg: PPOConfig) -> Data:
    """The prompt tables, cached until the data config or the files behind it change."""
    fingerprint = dataset_fingerprint(data=cfg.data)
    return prepare_dataset(data=cfg.data, fingerprint=fingerprint)


@dynamic(requests=CPU_SMALL, container_image=CPU_IMAGE)
def ppo_round(cfg: PPOConfig, train: Prompts, val: Prompts, base_model: FlyteDirectory, policy: FlyteDirectory,
              checkpoint: Optional[FlyteDirectory], state: Optional[RoundState], run_id: str,
              trial: Optional[TrialContext] = None) -> Rounds:
    """One round from `policy` (checkpoint `checkpoint`, state `state`; None for the first
    round, which validates the starting policy first), then the next round or the end.
    In a sweep's trial (`trial` given), `decide` also reports to the study's pruner."""
    _local_room_for_rounds(cfg.trainer.total_rounds)
    s = state or RoundState.initial(cfg)
    if state is None and P.should_validate_first(cfg, s):
        s = evaluate(cfg=cfg, policy=policy, val=val, state=s, run_id=run_id).state
    sampled = sample_prompts(cfg=cfg, train=train, state=s)
    if cfg.data.rollout_files:  # offline RLHF: the stored table replaces rollout and score
        scored = offline_rollout(cfg=cfg, policy=policy, state=sampled.state)
    else:
        rolled = rollout(cfg=cfg, policy=policy, prompts=sampled.prompts, state=sampled.state).with_overrides(
            **gpu_overrides(cfg.rollout.tensor_model_parallel_size))
        scored = score(cfg=cfg, rollouts=rolled)
    if cfg.reward.model_path:
        scored.with_overrides(**gpu_overrides(1))
    updated = update_task(cfg)(cfg=cfg, base_model=base_model, checkpoint=checkpoint, scored=scored,
                               state=sampled.state, run_id=run_id).with_overrides(
        task_config=elastic_for(cfg), **gpu_overrides(cfg.trainer.n_gpus_per_node))
    s = updated.state
    done = (state.round if state else 0) + 1
    if P.should_evaluate(cfg, done):
        s = evaluate(cfg=cfg, policy=updated.policy, val=val, state=s, run_id=run_id).state
    verdict = decide(cfg=cfg, state=s, steps=updated.steps, trial=trial)
    if done >= cfg.trainer.total_rounds:
        return Rounds(model=updated.policy, state=verdict.state)
    return (conditional("early_stop")
            .if_(verdict.stop.is_true())
            .then(finish(model=updated.policy, state=verdict.state))
            .else_()
            .then(ppo_round(cfg=cfg, train=train, val=val, base_model=base_model, policy=updated.policy,
                            checkpoint=updated.checkpoint, state=verdict.state, run_id=run_id, trial=trial)))


# Python frames one round's recursion level takes in flytekit's local executor (about 11
# measured), with room to spare.
LOCAL_FRAMES_PER_ROUND = 40


def _local_room_for_rounds(total_rounds: int) -> None:
    """Local execution only (on a cluster every task has its own pod and nothing changes), where
    the rounds' recursion runs in one Python process: give this round's tasks a sandbox beside
    the others rather than one named after every enclosing round's (flytekit prefixes a local
    task sandbox with its parent's path, which passes the file-name length limit after about 30
    rounds), and raise the interpreter's recursion limit to fit `total_rounds` levels."""
    import os
    import sys
    import tempfile

    from flytekit.core.context_manager import FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    if state is None or not state.is_local_execution() or state.user_space_params is None:
        return
    params = state.user_space_params
    current = str(getattr(params.working_directory, "name", params.working_directory))
    params._working_directory = tempfile.mkdtemp(prefix="round", dir=os.path.dirname(current.rstrip("/")))
    needed = 1000 + LOCAL_FRAMES_PER_ROUND * total_rounds
    if sys.getrecursionlimit() < needed:
        sys.setrecursionlimit(needed)


def gpu_overrides(n_gpus: int) -> dict:
    """Node overrides asking for `n_gpus` GPUs (requests and limits)."""
    return {"requests": gpu_resources(n_gpus), "limits": gpu_resources(n_gpus)}


@workflow
def ppo_train(cfg: PPOConfig, train: Prompts, val: Prompts, base_model: FlyteDirectory) -> Trained:
    """PPO rounds from `base_model` (also the KL reference) on the given prompt tables."""
    run_id = start_tracking(cfg=cfg)
    fitted = fit_prompts(cfg=cfg, train=train, val=val, policy=base_model)
    rounds = ppo_round(cfg=cfg, train=fitted.train, val=fitted.val, base_model=base_model, policy=base_model,
                       checkpoint=None, state=None, run_id=run_id)
    metrics = report(cfg=cfg, state=rounds.state, run_id=run_id)
    return Trained(model=rounds.model, metrics=metrics, state=rounds.state, run_id=run_id)


@workflow
def ppo_pipeline(cfg: PPOConfig = PPOConfig()) -> Pipeline:
    """Data, starting policy (`model.path`, or the tiny model SFT-warm-started in code), PPO
    rounds; returns the final policy directory, the per-step metrics table and the state."""
    checked = check_config(cfg=cfg)
    data = prepare_data(cfg=checked)
    base = prepare_policy(model=checked.model, seed=checked.trainer.seed, sft=data.sft)
    trained = ppo_train(cfg=checked, train=data.train, val=data.val, base_model=base)
    return Pipeline(model=trained.model, metrics=trained.metrics, state=trained.state)


@workflow
def ppo_offline(cfg: PPOConfig = PPOConfig(), rollout_files: str = "") -> Pipeline:
    """`ppo_pipeline` trained from stored rollouts (`rollout_files`, or `data.rollout_files`)
    instead of generated ones: offline RLHF, no rollout engine in the rounds."""
    return ppo_pipeline(cfg=offline_config(cfg=cfg, rollout_files=rollout_files))
