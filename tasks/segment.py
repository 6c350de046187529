"""The colocated segment: `trainer.rounds_per_segment` rounds in one GPU task under torchrun
(kfpytorch `Elastic`, shaped by the run's `cfg` as `ppo_update` is), the rollout engine and
the trainer kept alive across its rounds (`rlhf.train.segment.run_segment`).

Every `trainer.save_freq` rounds the segment's checkpoint becomes the Flyte intratask
checkpoint (`tasks.intratask`); an interrupted attempt's retry resumes from it. The task
returns the checkpoint after its last round, the policy inside it (a reference, not a second
upload), the state, the last round's step metrics for `decide`, the segment's metrics table
and the last round's rollout and scored tables.
"""

from __future__ import annotations

import contextvars
from typing import NamedTuple, Optional

import pandas as pd
from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory

from containers.images import GPU_IMAGE
from rlhf.train import setup as S
from rlhf.config.schema import PPOConfig
from rlhf.train.segment import run_segment, segment_end
from rlhf.round.state import RoundState
from tasks import intratask
from tasks.evaluate import print_round
from tasks.base import (DECK_FIELDS, GPU, GPU_RETRIES, TRACKING_SECRETS, Prompts, Rollouts, Scored, gpu_resources,
                        local_copy, rank, retry_transient, workdir)
from tasks.update import RDZV, RunShapedElastic, RunShapedElasticTask, checkpoint_outputs, elastic_for

Segment = NamedTuple("Segment", [("checkpoint", FlyteDirectory), ("policy", FlyteDirectory), ("state", RoundState),
                                 ("steps", list[dict[str, float]]), ("metrics", pd.DataFrame),
                                 ("rollouts", Rollouts), ("scored", Scored), ("stopped", bool)])


def _segment(cfg: PPOConfig, train: Prompts, val: Prompts, base_model: FlyteDirectory,
             checkpoint: Optional[FlyteDirectory], state: RoundState, run_id: str) -> Segment:
    sink = S.tracking_sink(cfg, run_id, state) if rank() == 0 else None
    # The writer thread uploads each sealed checkpoint: it runs in this task's Flyte context
    # (a ContextVar, which a new thread would not see).
    context = contextvars.copy_context()
    end = segment_end(cfg, state.round)

    def round_line(run, result) -> None:  # the segment's last round has its line from `decide`
        if run.rank == 0 and run.state.round < end:
            print_round(cfg, run.state, result.steps)

    with retry_transient():
        resume = intratask.restore()
        r = run_segment(cfg, local_copy(base_model), train, val, local_copy(checkpoint) if checkpoint else None,
                        state, workdir("segment"), sink=sink, resume=str(resume) if resume else None,
                        on_checkpoint=lambda path: context.run(intratask.save, path), on_round=round_line)
    out = S.keep_pending(sink, r.state) if sink is not None else r.state
    Deck("segment", r.metrics.to_html(index=False, float_format=lambda x: f"{x:.5g}"))
    ckpt_dir, policy, out = checkpoint_outputs(r.checkpoint, out, cfg.trainer.max_ckpt_to_keep)
    return Segment(checkpoint=ckpt_dir, policy=policy, state=out, steps=r.steps, metrics=r.metrics,
                   rollouts=r.rollouts, scored=r.scored, stopped=r.stopped)


_SEGMENT_TASK = dict(requests=gpu_resources(1), limits=gpu_resources(1), accelerator=GPU, shared_memory=True,
                     interruptible=True, retries=GPU_RETRIES, container_image=GPU_IMAGE,
                     secret_requests=TRACKING_SECRETS, enable_deck=True, deck_fields=DECK_FIELDS)


@task(task_config=RunShapedElastic(nnodes=1, nproc_per_node=1, rdzv_configs=RDZV), **_SEGMENT_TASK)
def ppo_segment(cfg: PPOConfig, train: Prompts, val: Prompts, base_model: FlyteDirectory,
                checkpoint: Optional[FlyteDirectory], state: RoundState, run_id: str) -> Segment:
    """`trainer.rounds_per_segment` rounds after `state.round` from `checkpoint` (the base
    policy for the first segment), in one process group; the last round's validation and
    decision are the workflow's."""
    return _segment(cfg, train, val, base_model, checkpoint, state, run_id)


@task(task_config=RunShapedElastic(nnodes=2, nproc_per_node=8, rdzv_configs=RDZV),
      **{**_SEGMENT_TASK, "requests": gpu_resources(8), "limits": gpu_resources(8)})
def ppo_segment_multinode(cfg: PPOConfig, train: Prompts, val: Prompts, base_model: FlyteDirectory,
                          checkpoint: Optional[FlyteDirectory], state: RoundState, run_id: str) -> Segment:
    """`ppo_segment` as a multi-pod PyTorchJob (a shared filesystem for the working directory,
    as `ppo_update_multinode` needs)."""
    return _segment(cfg, train, val, base_model, checkpoint, state, run_id)


def segment_task(cfg: PPOConfig):
    """The segment task for this run's node count (see `tasks.update.update_task`)."""
    t = ppo_segment if cfg.trainer.nnodes == 1 else ppo_segment_multinode
    t.min_nodes, t.max_nodes = RunShapedElasticTask.min_nodes_max_nodes(elastic_for(cfg))
    return t
