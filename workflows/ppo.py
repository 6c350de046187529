"""The PPO pipeline: prepare data and the starting policy, then rounds until `total_rounds`
or an early stop, then the report.

    pyflyte run workflows/ppo.py ppo_pipeline                 # embedded default, CPU
    pyflyte run workflows/ppo.py ppo_pipeline --cfg my.yaml   # any PPOConfig as YAML/JSON

The rounds are a chain (`ppo_rounds`, not recursive), at one of two granularities
(`trainer.granularity`), composing the same stage functions as `rlhf.train`:

    segment:  [ppo_segment (K rounds in one GPU task) -> evaluate -> decide] -> ... -> final_policy -> report
    stage:    [sample_prompts -> rollout -> score -> ppo_update -> evaluate -> decide] -> ... -> final_policy -> report

each link after the first behind a condition on the previous link's stop verdict.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import NamedTuple, Optional, Union

import pandas as pd
from flytekit import conditional, dynamic, workflow
from flytekit.types.directory import FlyteDirectory

from containers.images import CPU_IMAGE
from rlhf.train import stateless as P
from rlhf.config.schema import PPOConfig
from rlhf.train.segment import segment_end, segment_starts
from rlhf.round.state import RoundState
from rlhf.tracking.trial import TrialContext
from tasks.base import CPU_SMALL, Prompts, gpu_resources
from tasks.data import (dataset_fingerprint, fit_prompts, prepare_dataset, prepare_policy, rounds_from_epochs,
                        sample_prompts)
from tasks.evaluate import decide, evaluate, generation_gpus
from tasks.offline import offline_config, offline_rollout
from tasks.rollout import rollout, score_task
from tasks.run import check_config, fail_tracking, final_policy, report, resume_point, start_tracking
from tasks.segment import segment_task
from tasks.update import elastic_for, update_task

Rounds = NamedTuple("Rounds", [("model", FlyteDirectory), ("state", RoundState)])
Link = NamedTuple("Link", [("model", FlyteDirectory), ("checkpoint", FlyteDirectory), ("state", RoundState),
                           ("stop", bool)])
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
def ppo_rounds(cfg: PPOConfig, train: Prompts, val: Prompts, base_model: FlyteDirectory, run_id: str,
               trial: Optional[TrialContext] = None) -> Rounds:
    """The run's rounds as a chain, built at once and not recursive: one link per segment
    (`trainer.granularity=segment`, `rounds_per_segment` rounds each) or per round (`stage`),
    each link after the first behind a condition on the previous link's stop verdict. With
    `trainer.resume` naming a checkpoint (path or URI), the chain starts from it (weights,
    optimizer state, round state); otherwise from `base_model`, validated first when
    `val_before_train`."""
    start = resume_point(cfg)
    if start is not None:
        uri, s = start
        policy, checkpoint = FlyteDirectory(path=f"{uri.rstrip('/')}/actor"), FlyteDirectory(path=uri)
    else:
        checkpoint, policy, s = None, base_model, RoundState.initial(cfg)
        if "wandb" in cfg.trainer.logger:  # one wandb run for every task of the execution
            s = dataclasses.replace(s, wandb_id=uuid.uuid4().hex)
    first = s.round  # a plain value: `s` becomes a promise below when the start is validated
    if first >= cfg.trainer.total_rounds:
        return Rounds(model=policy, state=s)
    if start is None and P.should_validate_first(cfg, s):
        s = evaluate(cfg=cfg, policy=base_model, val=val, state=s, run_id=run_id).with_overrides(
            **gpu_overrides(generation_gpus(cfg))).state
    link_wf = ppo_segment_link if cfg.trainer.granularity == "segment" else ppo_round
    # A resumed run's first link goes from its round to the next segment boundary.
    starts = [first] + [r for r in link_starts(cfg) if r > first]
    link = link_wf(cfg=cfg, train=train, val=val, base_model=base_model, policy=policy, checkpoint=checkpoint,
                   state=s, run_id=run_id, trial=trial)
    for r in starts[1:]:
        link = (conditional(f"continue_after_round_{r}")
                .if_(link.stop.is_true())
                .then(stopped(model=link.model, checkpoint=link.checkpoint, state=link.state, stop=link.stop))
                .else_()
                .then(link_wf(cfg=cfg, train=train, val=val, base_model=base_model, policy=link.model,
                              checkpoint=link.checkpoint, state=link.state, run_id=run_id, trial=trial)))
    return Rounds(model=link.model, state=link.state)


def link_starts(cfg: PPOConfig) -> list[int]:
    """The round counts the chain's links start from (a run resumed at round r starts there)."""
    if cfg.trainer.granularity == "segment":
        return segment_starts(cfg)
    return list(range(cfg.trainer.total_rounds))


@workflow
def stopped(model: FlyteDirectory, checkpoint: FlyteDirectory, state: RoundState, stop: bool) -> Link:
    """A link after an early stop: the stopped run's values passed on, no task run."""
    return Link(model=model, checkpoint=checkpoint, state=state, stop=stop)


@dynamic(requests=CPU_SMALL, container_image=CPU_IMAGE)
def ppo_segment_link(cfg: PPOConfig, train: Prompts, val: Prompts, base_model: FlyteDirectory,
                     policy: FlyteDirectory, checkpoint: Optional[FlyteDirectory], state: RoundState, run_id: str,
                     trial: Optional[TrialContext] = None) -> Link:
    """One colocated segment (its rounds in one GPU task), then the validation of its last
    round (when scheduled) and the early-stop decision, as tasks with their own decks.
    `policy` is the segment's starting policy (inside `checkpoint`; the base one first)."""
    del policy  # the segment builds the policy from `checkpoint` (or the base model)
    seg = segment_task(cfg)(cfg=cfg, train=train, val=val, base_model=base_model, checkpoint=checkpoint,
                            state=state, run_id=run_id).with_overrides(
        task_config=elastic_for(cfg), **gpu_overrides(cfg.trainer.n_gpus_per_node))
    s = seg.state
    if P.should_evaluate(cfg, segment_end(cfg, state.round)):
        s = evaluate(cfg=cfg, policy=seg.policy, val=val, state=s, run_id=run_id).with_overrides(
            **gpu_overrides(generation_gpus(cfg))).state
    verdict = decide(cfg=cfg, state=s, steps=seg.steps, trial=trial)
    return Link(model=seg.policy, checkpoint=seg.checkpoint, state=verdict.state, stop=verdict.stop)


@dynamic(requests=CPU_SMALL, container_image=CPU_IMAGE)
def ppo_round(cfg: PPOConfig, train: Prompts, val: Prompts, base_model: FlyteDirectory, policy: FlyteDirectory,
              checkpoint: Optional[FlyteDirectory], state: RoundState, run_id: str,
              trial: Optional[TrialContext] = None) -> Link:
    """One round, a task per stage, from `policy` (checkpoint `checkpoint`; none for the first
    round). In a sweep's trial (`trial` given), `decide` also reports to the study's pruner."""
    sampled = sample_prompts(cfg=cfg, train=train, state=state)
    if cfg.data.rollout_files:  # offline RLHF: the stored table replaces rollout and score
        scored = offline_rollout(cfg=cfg, policy=policy, state=sampled.state)
    else:
        rolled = rollout(cfg=cfg, policy=policy, prompts=sampled.prompts, state=sampled.state).with_overrides(
            **gpu_overrides(generation_gpus(cfg)))
        scored = score_task(cfg)(cfg=cfg, rollouts=rolled.rollouts, timing=rolled.timing)
    updated = update_task(cfg)(cfg=cfg, base_model=base_model, checkpoint=checkpoint, scored=scored.scored,
                               state=sampled.state, run_id=run_id, timing=scored.timing).with_overrides(
        task_config=elastic_for(cfg), **gpu_overrides(cfg.trainer.n_gpus_per_node))
    s = updated.state
    done = state.round + 1
    if P.should_evaluate(cfg, done):
        s = evaluate(cfg=cfg, policy=updated.policy, val=val, state=s, run_id=run_id).with_overrides(
            **gpu_overrides(generation_gpus(cfg))).state
    verdict = decide(cfg=cfg, state=s, steps=updated.steps, trial=trial)
    return Link(model=updated.policy, checkpoint=updated.checkpoint, state=verdict.state, stop=verdict.stop)


def gpu_overrides(n_gpus: int) -> dict:
    """Node overrides asking for `n_gpus` GPUs (requests and limits)."""
    return {"requests": gpu_resources(n_gpus), "limits": gpu_resources(n_gpus)}


@workflow
def ppo_train(cfg: PPOConfig, train: Prompts, val: Prompts, base_model: FlyteDirectory) -> Trained:
    """PPO rounds from `base_model` (also the KL reference) on the given prompt tables. The
    trained `model` is the final policy; with LoRA and `trainer.save_merged`, its adapters
    merged into `base_model` (a plain model directory, `final_policy`)."""
    run_id = start_tracking(cfg=cfg)
    fitted = fit_prompts(cfg=cfg, train=train, val=val, policy=base_model)
    run_cfg = rounds_from_epochs(cfg=cfg, train=fitted.train)
    rounds = ppo_rounds(cfg=run_cfg, train=fitted.train, val=fitted.val, base_model=base_model, run_id=run_id)
    model = final_policy(cfg=run_cfg, base_model=base_model, policy=rounds.model)
    metrics = report(cfg=run_cfg, state=rounds.state, run_id=run_id, model=model)
    return Trained(model=model, metrics=metrics, state=rounds.state, run_id=run_id)


@workflow(on_failure=fail_tracking)
def ppo_pipeline(cfg: Optional[Union[PPOConfig, str]] = None) -> Pipeline:
    """Data, starting policy (`model.path`, or the tiny model SFT-warm-started in code), PPO
    rounds; returns the final policy directory, the per-step metrics table and the state.
    With LoRA and `trainer.save_merged`, the policy directory is the adapters merged into the
    base (a plain model directory). Check a launch first, in seconds: python -m rlhf.train.check --cfg my.yaml

    :param cfg: a YAML or JSON file with the config keys to change (all of them, with their meaning and
        default: docs/CONFIG.md); left out, the defaults: a tiny model on synthetic arithmetic, on the CPU
    """
    # `cfg` may also arrive as the file's path: pyflyte passes the path on when it cannot decode
    # the file into a config itself, and the first task reads it, naming what is wrong.
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
