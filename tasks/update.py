"""The PPO update under torchrun (flytekitplugins-kfpytorch `Elastic`), DeepSpeed inside.

`ppo_update` runs `nproc_per_node` ranks in one pod; `ppo_update_multinode` is the same
body as a PyTorchJob over several pods (Kubeflow training operator). The workflow picks
one per run (`update_task`) and sets the torchrun shape from `trainer.nnodes` and
`trainer.n_gpus_per_node` with `with_overrides(task_config=...)`. Every rank runs the task
function; Flyte keeps rank 0's outputs.

A pod resolves its task from the module, with the decorator's `Elastic`, so a node
override alone would not reach the launcher inside the pod: `RunShapedElastic` tasks read
the shape from their `cfg` input when they start, which keeps the launcher, the
serialized PyTorchJob and local runs in agreement. With a single rank in all, the task
runs in its own process, without the launcher.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Optional

from flytekit import FlyteContextManager, PythonFunctionTask, task
from flytekit.extend import TaskPlugins
from flytekit.types.directory import FlyteDirectory
from flytekitplugins.kfpytorch import Elastic
from flytekitplugins.kfpytorch.task import PytorchElasticFunctionTask

from containers.images import GPU_IMAGE
from rlhf.train import stateless as P
from rlhf.train import setup as S
from rlhf.config.schema import PPOConfig
from rlhf.round.state import RoundState
from tasks.base import (GPU, GPU_RETRIES, TRACKING_SECRETS, Scored, gpu_resources, local_copy, rank,
                        retry_transient, workdir)

Updated = NamedTuple("Updated", [("checkpoint", FlyteDirectory), ("policy", FlyteDirectory),
                                 ("state", RoundState), ("steps", list[dict[str, float]])])

log = logging.getLogger(__name__)
# Rendezvous waits for pods that start late (image pulls, node scale-up).
RDZV = {"timeout": 900, "join_timeout": 900}


@dataclass
class RunShapedElastic(Elastic):
    """`Elastic` whose node and per-node process counts follow the task's `cfg` input
    (`trainer.nnodes`, `trainer.n_gpus_per_node`) when the task runs."""


class RunShapedElasticTask(PytorchElasticFunctionTask):
    def execute(self, **kwargs) -> Any:
        _set_task_config(self, elastic_for(kwargs["cfg"]))
        self.min_nodes, self.max_nodes = self.min_nodes_max_nodes(self.task_config)
        if self.max_nodes == 1 and self.task_config.nproc_per_node == 1:
            # One rank: the launcher would only add a process start (imports, ~10 s); the
            # engine makes its own one-rank process group in this process instead.
            return PythonFunctionTask.execute(self, **kwargs)
        return super().execute(**kwargs)

    @staticmethod
    def min_nodes_max_nodes(config: Elastic) -> tuple[int, int]:
        from torch.distributed import run

        return run.parse_min_max_nnodes(str(config.nnodes))


def _set_task_config(task: PythonFunctionTask, config: Elastic) -> None:
    """Give `task` the torchrun shape `config`. flytekit's `task_config` is a read-only
    property over the private `_task_config`, set when the task is declared; the shape of a
    run is known only from the task's `cfg` input when it executes, so this is the one place
    that writes the private attribute (the plugin's `execute` reads `task_config`)."""
    task._task_config = config


TaskPlugins.register_pythontask_plugin(RunShapedElastic, RunShapedElasticTask)


def elastic_for(cfg: PPOConfig) -> RunShapedElastic:
    """The torchrun shape of a run: `trainer.nnodes` pods x `trainer.n_gpus_per_node` ranks."""
    return RunShapedElastic(nnodes=cfg.trainer.nnodes, nproc_per_node=cfg.trainer.n_gpus_per_node,
                            rdzv_configs=RDZV)


def checkpoint_outputs(local: str, state: RoundState, keep: int
                       ) -> tuple[FlyteDirectory, FlyteDirectory, RoundState]:
    """A checkpoint directory as a task output; its `actor/` policy as a second output that
    refers to the uploaded checkpoint's sub-folder instead of uploading the weights again;
    and the state listing the new checkpoint's URI. The run's older checkpoints are removed
    from the store beyond `trainer.max_ckpt_to_keep`, always keeping this task's input (a
    retry of this task starts from it again)."""
    ctx = FlyteContextManager.current_context()
    local_run = ctx.execution_state is not None and ctx.execution_state.is_local_execution()
    # On the store the checkpoint keeps its round name (<random prefix>/round_NNNNNN/).
    uri = local if local_run else f"{ctx.file_access.get_random_remote_directory().rstrip('/')}/{Path(local).name}"
    kept = state.checkpoints[-max(1, keep - 1):] if state.checkpoints else []
    for old in state.checkpoints[:len(state.checkpoints) - len(kept)]:
        try:
            ctx.file_access.get_filesystem_for_path(old).rm(old, recursive=True)
        except (FileNotFoundError, OSError) as e:  # gone already, or the store refuses: nothing depends on it
            log.warning("could not remove old checkpoint %s: %s", old, e)
    new = replace(state, checkpoints=[*kept, uri])
    if local_run:
        return FlyteDirectory(path=local), FlyteDirectory(path=str(Path(local) / "actor")), new
    return (FlyteDirectory(path=local, remote_directory=uri), FlyteDirectory(path=f"{uri.rstrip('/')}/actor"), new)


def _update(cfg: PPOConfig, base_model: FlyteDirectory, checkpoint: Optional[FlyteDirectory], scored: Scored,
            state: RoundState, run_id: str, timing: dict[str, float]) -> Updated:
    sink = S.tracking_sink(cfg, run_id, state) if rank() == 0 else None
    with retry_transient():
        r = P.update_from_checkpoint(cfg, local_copy(base_model), local_copy(checkpoint) if checkpoint else None,
                                     scored, state, workdir("checkpoints"), sink=sink, timing=timing)
    out = S.keep_pending(sink, r.state) if sink is not None else r.state
    ckpt_dir, policy, out = checkpoint_outputs(r.checkpoint, out, cfg.trainer.max_ckpt_to_keep)
    return Updated(checkpoint=ckpt_dir, policy=policy, state=out, steps=r.steps)


@task(task_config=RunShapedElastic(nnodes=1, nproc_per_node=1, rdzv_configs=RDZV), requests=gpu_resources(1),
      limits=gpu_resources(1), accelerator=GPU, shared_memory=True, interruptible=True, retries=GPU_RETRIES,
      container_image=GPU_IMAGE, secret_requests=TRACKING_SECRETS)
def ppo_update(cfg: PPOConfig, base_model: FlyteDirectory, checkpoint: Optional[FlyteDirectory], scored: Scored,
               state: RoundState, run_id: str, timing: dict[str, float]) -> Updated:
    """`steps_per_round` PPO steps from the previous round's checkpoint (weights and DeepSpeed
    optimizer state; the base policy in round 1); returns the new checkpoint, the updated
    policy directory, the state and the per-step metrics (with the round's generation
    `timing`)."""
    return _update(cfg, base_model, checkpoint, scored, state, run_id, timing)


@task(task_config=RunShapedElastic(nnodes=2, nproc_per_node=8, rdzv_configs=RDZV), requests=gpu_resources(8),
      limits=gpu_resources(8), accelerator=GPU, shared_memory=True, interruptible=True, retries=GPU_RETRIES,
      container_image=GPU_IMAGE, secret_requests=TRACKING_SECRETS)
def ppo_update_multinode(cfg: PPOConfig, base_model: FlyteDirectory, checkpoint: Optional[FlyteDirectory],
                         scored: Scored, state: RoundState, run_id: str, timing: dict[str, float]) -> Updated:
    """`ppo_update` as a multi-pod PyTorchJob. Rank 0 writes the checkpoint; under ZeRO >= 1
    every rank also writes its optimizer shard there, so the pods need a shared filesystem
    for the task's working directory (docs/FLYTE.md)."""
    return _update(cfg, base_model, checkpoint, scored, state, run_id, timing)


def update_task(cfg: PPOConfig):
    """The update task for this run's node count. Its node count is set here as well, for the
    PyTorchJob that the workflow serializes (the plugin reads it when the task is created)."""
    t = ppo_update if cfg.trainer.nnodes == 1 else ppo_update_multinode
    t.min_nodes, t.max_nodes = RunShapedElasticTask.min_nodes_max_nodes(elastic_for(cfg))
    return t
