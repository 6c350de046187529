"""DeepSpeed's CPU communication op without a JIT build that can hang a run.

On a machine without CUDA, DeepSpeed's first `init_distributed` JIT-compiles a shared-memory
all-reduce op (`deepspeed_shm_comm`, ~1.5-2.5 minutes) under a lock file,
`<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/py<ver>_cpu/deepspeed_shm_comm/lock`.
A process killed during that build leaves the lock behind, and every later run waits on it
forever, silently (torch's `FileBaton` only polls for the file).

`prepare_cpu_comm()`, called before `deepspeed.initialize`, makes that impossible:

- by default DeepSpeed is told the op is unavailable, so no build starts and collectives go
  through torch's gloo backend (what a CPU run of this project's model sizes needs; the op
  only speeds up all-reduce between ranks of one host);
- with `RLHF_DS_SHM_COMM=1` the op is built and used, after lock files that no live process
  holds open (a builder keeps its lock open while it builds) are removed with a warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rlhf.trainer.deepspeed_internals import mark_op_incompatible

log = logging.getLogger(__name__)

SHM_OP = "deepspeed_shm_comm"
ENV_USE_SHM = "RLHF_DS_SHM_COMM"


def extensions_root() -> Path:
    """Where torch JIT-builds extensions: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "torch_extensions"


def _open_files() -> set[str]:
    """Paths that some process on this machine has open (those whose /proc entries we may read)."""
    held: set[str] = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    held.add(os.readlink(fd))
                except OSError:
                    continue
        except OSError:
            continue
    return held


def stale_locks(root: Path | None = None, op: str = SHM_OP) -> list[Path]:
    """Build locks of `op` under `root` that no live process holds open (left by a killed build)."""
    root = root or extensions_root()
    locks = sorted(root.glob(f"*/{op}/lock")) + sorted(root.glob(f"{op}/lock"))
    if not locks:
        return []
    held = _open_files()
    return [lock for lock in locks if str(lock.resolve()) not in held and str(lock) not in held]


def remove_stale_locks(root: Path | None = None, op: str = SHM_OP) -> list[Path]:
    """Remove `stale_locks`, each with a warning naming it; returns the removed paths."""
    removed = []
    for lock in stale_locks(root, op):
        log.warning("removing %s: a build lock of DeepSpeed's %s op that no running process holds (left by a "
                    "build that was killed); without this the build would wait on it forever", lock, op)
        try:
            lock.unlink()
            removed.append(lock)
        except FileNotFoundError:
            continue
    return removed


def prepare_cpu_comm() -> str:
    """Before `deepspeed.initialize` on a CPU accelerator: skip the shared-memory op's JIT build
    (default) or clear stale build locks first (`RLHF_DS_SHM_COMM=1`). Returns what was done:
    "skipped", "built" or "" (not a CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return ""
    if os.environ.get(ENV_USE_SHM, "") == "1":
        remove_stale_locks()
        return "built"
    mark_op_incompatible(SHM_OP)
    return "skipped"
