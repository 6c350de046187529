"""What the task modules share: the typed tables, resource presets and error mapping.

Tables cross task boundaries as pandera-typed DataFrames (parquet underneath), validated
on every input and output by flytekitplugins-pandera, whose report is published as a deck.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple

import click
import flytekitplugins.pandera  # noqa: F401  (registers the pandera DataFrame type)
import torch.distributed as dist
from flytekit import FlyteContextManager, Resources, Secret, current_context
from flytekit.deck import DeckField
from flytekit.exceptions.user import FlyteRecoverableException
from flytekit.extras.accelerators import H100
from flytekit.types.directory import FlyteDirectory
from pandera.typing import DataFrame

from rlhf.checkpoint.rounds import MANIFEST_FILE
from rlhf.config.schema import ConfigError
from schemas.prompts import PromptSchema, RolloutSchema, ScoredRolloutSchema

Prompts = DataFrame[PromptSchema]
Rollouts = DataFrame[RolloutSchema]
Scored = DataFrame[ScoredRolloutSchema]
# A round's rows after a stage, with the round's stage timings so far (`timing_s/gen`, `timing_s/reward`).
Rolled = NamedTuple("Rolled", [("rollouts", Rollouts), ("timing", dict[str, float])])
ScoredRound = NamedTuple("ScoredRound", [("scored", Scored), ("timing", dict[str, float])])

CACHE_VERSION = "1"  # bump when a cached task's code changes its outputs
GPU = H100  # the accelerator GPU tasks ask for; one constant to change per cluster
CPU_SMALL = Resources(cpu="1", mem="2Gi")
CPU_MEDIUM = Resources(cpu="4", mem="16Gi")
CPU_LARGE = Resources(cpu="4", mem="64Gi")  # a whole model in host memory (a 7B model in float32 is 28 GB)
GPU_RETRIES = 2  # GPU tasks run on interruptible (spot) nodes
DECK = "training"  # the deck with the training curves
# Decks a task with `enable_deck` shows after its own (the first one opens by default);
# the source-code and dependency decks would cost ~0.7 s per task, every round.
DECK_FIELDS = (DeckField.INPUT, DeckField.OUTPUT)
# Tasks that talk to MLflow get its token from the Flyte secret `mlflow/tracking_token` as
# $MLFLOW_TRACKING_TOKEN (which MLflow reads): never a task input, so it is not stored with the
# execution, shown in decks or logged as a param. A tracking server without a token needs no
# secret: set this to [] (or create the secret with any value). Other credentials (object
# store keys) come from the pod's environment or service account in the same way.
TRACKING_SECRETS = [Secret(group="mlflow", key="tracking_token", env_var="MLFLOW_TRACKING_TOKEN",
                           mount_requirement=Secret.MountType.ENV_VAR)]


def gpu_resources(n_gpus: int) -> Resources:
    """Requests for `n_gpus` GPUs with host CPU and memory in proportion."""
    n = max(1, n_gpus)
    return Resources(cpu=str(8 * n), mem=f"{64 * n}Gi", gpu=str(n))


def workdir(name: str) -> str:
    """A fresh directory of this task execution for outputs that Flyte uploads."""
    path = Path(current_context().working_directory) / name
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def local_copy(directory: FlyteDirectory) -> str:
    """A local path of `directory`, downloaded once per pod: the ranks of a torchrun task share
    one copy (the first to take the lock downloads it into a folder named after the source,
    the others wait and find it complete). A source that is already a local directory (local
    execution) is read where it is."""
    return _local(directory, policy=False)


def local_policy(policy: FlyteDirectory) -> str:
    """`local_copy` of a policy directory. When it is a round checkpoint's `actor/` on a store,
    the checkpoint's `manifest.json` is fetched beside the copy (`<copy>/../manifest.json`), so
    that the engine checks the policy's files against their digests before it generates
    (`rlhf.train.setup.policy_engine`); a local one is read where it is, beside its manifest."""
    return _local(policy, policy=True)


def _local(directory: FlyteDirectory, policy: bool) -> str:
    import fcntl
    import hashlib
    import shutil
    import tempfile

    src = str(directory.remote_source or directory.path)
    ctx = FlyteContextManager.current_context()
    if not ctx.file_access.is_remote(src) and os.path.isdir(src):
        return src
    dest = Path(tempfile.gettempdir()) / "flyte-rlhf-inputs" / hashlib.sha256(src.encode()).hexdigest()[:16]
    name = src.rstrip("/").rsplit("/", 1)[-1] if policy else ""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{dest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = Path(f"{dest}.done")  # beside the copy, not in it: a checkpoint's files stay its own
        if not done.is_file():
            tmp = Path(f"{dest}.partial")
            shutil.rmtree(tmp, ignore_errors=True)
            ctx.file_access.get_data(src, str(tmp / name), is_multipart=True)
            if policy:
                _fetch_manifest(ctx, src, tmp)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
            done.write_text(src)
    return str(dest / name)


def _fetch_manifest(ctx, src: str, into: Path) -> None:
    """The manifest of the checkpoint a policy URI lies in, into `into`; none when the policy is
    not inside a checkpoint (a base model)."""
    parent = src.rstrip("/").rsplit("/", 1)[0]
    try:
        ctx.file_access.get_data(f"{parent}/{MANIFEST_FILE}", str(into / MANIFEST_FILE))
    except TRANSIENT:
        raise
    except Exception:  # flytekit wraps a missing source in its own download error
        pass


class LaunchError(ConfigError, click.ClickException):
    """A launch that cannot run, found by a task (a config value, a checkpoint to start from):
    `pyflyte run` prints its message alone, one line without a traceback (click shows a
    `ClickException` so); anywhere else it is the `ConfigError` it is."""

    def __init__(self, message: str):
        click.ClickException.__init__(self, message)


def rank() -> int:
    """Global rank under torchrun (0 outside it)."""
    return int(os.environ.get("RANK", "0"))


# Failures a retry on a fresh pod can fix: lost connections, storage timeouts, rendezvous
# and collective timeouts between ranks. Everything else (bad config, bad data, OOM) fails.
TRANSIENT: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, dist.DistNetworkError,
                                              dist.DistStoreError)


@contextmanager
def retry_transient() -> Iterator[None]:
    """Re-raise transient failures as `FlyteRecoverableException`, so Flyte retries the task."""
    try:
        yield
    except TRANSIENT as e:
        raise FlyteRecoverableException(f"transient failure, retrying: {type(e).__name__}: {e}") from e


def launch_seconds() -> float | None:
    """Wall time so far of a local execution (this process's age: every task of a local launch
    runs in it); None on a cluster, where each task has its own pod."""
    import time

    import psutil
    from flytekit.core.context_manager import FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    if state is not None and not state.is_local_execution():
        return None
    return time.time() - psutil.Process().create_time()
