"""Checkpoint files written off the training loop's critical path, and checksummed.

A save (`rlhf.checkpoint.rounds.save`) gathers references to the state it needs (model weights,
DeepSpeed's optimizer state) and hands them to a `CheckpointWriter`, whose thread copies
them off the device into host buffers kept between saves and then writes, fsyncs and
hashes each file (`rlhf.checkpoint.tensor_files`: in parallel pieces, hashed as written).
The trainer runs on meanwhile: the next round's rollout, evaluation and the forward and backward passes of its update read those tensors but do not change them;
the first optimizer step does, so a step pre-hook makes it wait until the copy is done.
Each rank writes its own files and then a marker holding their digests; rank 0's writer waits for every rank's marker, writes the manifest (every
file's size and digest) and renames the directory into place, so a crash anywhere before
that leaves only an unsealed temporary directory.

DeepSpeed writes its engine state through `engine.checkpoint_engine`; `CaptureEngine`
collects those state dicts instead of writing them, without the module weights (the
checkpoint's safetensors already hold them, so no weight is stored twice); each is written
as a skeleton with its tensors in a safetensors file beside it, and read back weights-only
(files of earlier versions, plain `torch.save`, through `rlhf.checkpoint.engine_state`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from rlhf.checkpoint.engine_state import load_weights_only
from rlhf.checkpoint.pieces import hash_name
from rlhf.checkpoint.tensor_files import data_path, load_device, load_state, save_state, write_safetensors

log = logging.getLogger("rlhf.checkpoint")

MARKER_WAIT_S = 3600.0  # rank 0 gives up on a rank whose files never appear


# ---------------------------------------------------------------------------------
# DeepSpeed's engine state, collected instead of written
# ---------------------------------------------------------------------------------


def capture_engine(device: Optional[torch.device] = None):
    """A DeepSpeed checkpoint engine that records `(path, state_dict)` in `.captured` on save
    (the module weights left out) and loads weights-only: a state `save_state` wrote with its
    tensors on `device` where it has room (`load_device`), a plain `torch.save` file as
    `map_location` says."""
    # deepspeed is heavy: loaded only by a save or restore, which has an engine already
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


    class CaptureEngine(TorchCheckpointEngine):
        def __init__(self):
            super().__init__()
            self.captured: list[tuple[Path, dict]] = []

        def save(self, state_dict, path: str):
            if isinstance(state_dict.get("module"), dict):
                state_dict = {**state_dict, "module": {}}  # the weights are the checkpoint's safetensors
            self.captured.append((Path(path), state_dict))

        def load(self, path: str, map_location=None):
            if data_path(Path(path)).is_file():
                return load_state(Path(path), load_device(Path(path), device or torch.device("cpu")))
            return load_weights_only(path, map_location=map_location)

    return CaptureEngine()


def keep_module_weights(src, dst) -> None:
    """`custom_load_fn` for DeepSpeed's `load_checkpoint`: the module already holds the
    checkpoint's weights (read from its safetensors), so nothing is loaded over them."""


# ---------------------------------------------------------------------------------
# Host copies
# ---------------------------------------------------------------------------------


class HostPool:
    """Host buffers a save's state is copied into, reused from one save to the next: a fresh
    40 GB allocation would pay its page faults (slow in a VM) on every save."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def copy(self, tree, key: str = "", fill: bool = True):
        """`tree` (nested dicts, lists, tuples) with every tensor copied into a host buffer
        (with `fill` false, the buffers are only allocated and their pages touched)."""
        if isinstance(tree, torch.Tensor):
            buf = self._bufs.get(key)
            if buf is None or buf.shape != tree.shape or buf.dtype != tree.dtype:
                buf = self._bufs[key] = torch.zeros(tree.shape, dtype=tree.dtype, device="cpu")
            return buf.copy_(tree.detach()) if fill else buf
        if isinstance(tree, dict):
            return {k: self.copy(v, f"{key}/{k}", fill) for k, v in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.copy(v, f"{key}/{i}", fill) for i, v in enumerate(tree))
        return tree


def _shapes(tree):
    """`tree` with each tensor replaced by an empty meta tensor of its shape and dtype."""
    if isinstance(tree, torch.Tensor):
        return torch.empty(tree.shape, dtype=tree.dtype, device="meta")
    if isinstance(tree, dict):
        return {k: _shapes(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_shapes(v) for v in tree)
    return tree


# ---------------------------------------------------------------------------------
# One rank's part of a save
# ---------------------------------------------------------------------------------


@dataclass
class TensorFile:
    path: Path  # where the file goes, inside the temporary checkpoint directory
    kind: str  # "state" (a nested state: skeleton and tensors, `save_state`) | "safetensors"
    tree: object  # the state to write: tensors anywhere in it, on any device


@dataclass
class SaveJob:
    """What one rank writes for one checkpoint, and (rank 0) how it is sealed."""

    tmp: Path
    rank: int
    world: int
    files: list[TensorFile]
    seal: Optional[Callable[[dict[str, str]], None]] = None  # rank 0: digests of all ranks -> manifest + rename
    ready: Optional[object] = None  # a CUDA event on the training stream: the state is final there
    device: Optional[torch.device] = None  # the CUDA device of `ready`
    digest: str = field(default_factory=hash_name)

    def run(self, pool: Optional[HostPool], copied: threading.Event) -> None:
        """Copy the state into `pool` (then set `copied`) and write it; without a pool, write
        each file straight from the state on its device (the caller waits, so nothing changes
        it meanwhile). Both give the same bytes."""
        try:
            if pool is None and self.ready is not None:
                self.ready.synchronize()  # the copy streams read what the training stream wrote
            trees = self._copy(pool) if pool is not None else [f.tree for f in self.files]
            copied.set()
            digests = {}
            for written in _write_all(self.files, trees, self.digest):
                for path, digest in written.items():
                    digests[str(path.relative_to(self.tmp))] = digest
            trees = None
            self.files = []  # the references to the live state go now
            _write_marker(self.tmp, self.rank, "done", json.dumps(digests))
            if self.seal is not None:
                self.seal(self._gather_digests(digests))
        except BaseException as e:
            copied.set()
            if self.tmp.is_dir():
                _write_marker(self.tmp, self.rank, "failed", f"{type(e).__name__}: {e}")
            raise

    def _copy(self, pool: HostPool) -> list:
        if self.ready is None:
            return [pool.copy(f.tree, self._key(f)) for f in self.files]
        # A side stream that starts where the training stream stood at save time, so the copy
        # overlaps whatever the training thread launches next (the next round's rollout).
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_event(self.ready)
        with torch.cuda.stream(stream):
            host = [pool.copy(f.tree, self._key(f)) for f in self.files]
        stream.synchronize()
        return host

    def _key(self, f: TensorFile) -> str:
        """The file's place in the checkpoint, the same in every save (the round's name is not
        part of it), so each save reuses the last one's buffers."""
        return str(f.path.relative_to(self.tmp))

    def _gather_digests(self, own: dict[str, str]) -> dict[str, str]:
        """Every rank's digests, from their markers (rank 0 waits for all of them)."""
        out, deadline = dict(own), time.monotonic() + MARKER_WAIT_S
        for r in range(1, self.world):
            done, failed = _marker(self.tmp, r, "done"), _marker(self.tmp, r, "failed")
            while not done.exists():
                if failed.exists():
                    raise RuntimeError(f"rank {r} failed to write its part of {self.tmp}: {failed.read_text()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} did not finish writing its part of {self.tmp} in "
                                       f"{MARKER_WAIT_S:.0f} s; the checkpoint stays unsealed")
                time.sleep(0.02)
            out.update(json.loads(done.read_text()))
        for r in range(self.world):
            _marker(self.tmp, r, "done").unlink(missing_ok=True)
        return out


def _write_all(files: list[TensorFile], trees: list, digest: str) -> list[dict[Path, str]]:
    """Write every file at once, one thread each (their pieces share the I/O pool, so
    several files fill it: on tmpfs, threads writing one file contend for it)."""
    if not files:
        return []
    with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="checkpoint-file") as ex:
        return list(ex.map(lambda i: _write(files[i].path, files[i].kind, trees[i], digest), range(len(files))))


def _write(path: Path, kind: str, tree, digest: str) -> dict[Path, str]:
    """Write one `TensorFile`'s state, fsynced; the digest of each file written."""
    if kind == "safetensors":
        return {path: write_safetensors(path, tree, {"format": "pt"}, digest)}
    if kind == "state":
        return save_state(path, tree, digest)
    raise ValueError(f"unknown tensor file kind '{kind}'")


def _marker(tmp: Path, rank: int, what: str) -> Path:
    return tmp / f".{what}.rank{rank}"


def _write_marker(tmp: Path, rank: int, what: str, text: str) -> None:
    p = _marker(tmp, rank, what)
    part = p.with_name(p.name + ".part")
    part.write_text(text)
    os.replace(part, p)  # a reader never sees a half-written marker


# ---------------------------------------------------------------------------------
# The writer thread
# ---------------------------------------------------------------------------------


class CheckpointWriter:
    """Runs one `SaveJob` at a time in a background thread. `submit` waits for the previous
    job; `wait_copied` returns once the state is on the host; `wait` once the files are
    written (and, on rank 0, sealed). While a copy is under way, any optimizer step of this
    process first waits for it (a global step pre-hook); `stalled_s` adds up those waits.
    An error in the thread is raised by the next call."""

    def __init__(self):
        self.pool = HostPool()
        self.stalled_s = 0.0
        self._thread: Optional[threading.Thread] = None
        self._copied = threading.Event()
        self._copied.set()
        self._error: Optional[BaseException] = None
        self._hook = None

    def _before_step(self, optimizer, args, kwargs) -> None:
        if not self._copied.is_set():
            self.stalled_s += self.wait_copied()

    def submit(self, job: SaveJob) -> None:
        self.wait()
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._hook = register_optimizer_step_pre_hook(self._before_step)
        self._copied = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(job, self._copied), name="checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def reserve(self, files: list[TensorFile], root: Path) -> None:
        """Allocate, in the thread, the host buffers a save of `files` (paths under `root`)
        will copy into: the first save then copies into memory whose pages exist, instead of
        stalling the next optimizer step on page faults (about 1 GB/s in a VM)."""
        self.wait()
        shapes = [(str(f.path.relative_to(root)), _shapes(f.tree)) for f in files]

        def run() -> None:
            try:
                for key, tree in shapes:
                    self.pool.copy(tree, key, fill=False)
            except BaseException as e:
                self._error = e

        self._thread = threading.Thread(target=run, name="checkpoint-reserve", daemon=True)
        self._thread.start()

    def _run(self, job: SaveJob, copied: threading.Event) -> None:
        try:
            job.run(self.pool, copied)
        except BaseException as e:  # raised in the training thread by the next wait
            log.error("checkpoint %s was not written: %s: %s", job.tmp, type(e).__name__, e)
            self._error = e

    def wait_copied(self) -> float:
        """Seconds blocked until the last submitted state is off the device."""
        t = time.perf_counter()
        self._copied.wait()
        self._raise()
        return time.perf_counter() - t

    def wait(self) -> float:
        """Seconds blocked until the last submitted job has finished."""
        t = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()
        return time.perf_counter() - t

    def close(self) -> None:
        """Wait for the last job and remove the step hook."""
        try:
            self.wait()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

    def take_stalled(self) -> float:
        """Seconds optimizer steps waited since the last call."""
        out, self.stalled_s = self.stalled_s, 0.0
        return out

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {type(e).__name__}: {e}") from e


def run_file_jobs(files: list[TensorFile]) -> None:
    """Write `files` now, in this thread (no markers, no seal)."""
    _sync_device()
    for f in files:
        _write(f.path, f.kind, f.tree, hash_name())


def _sync_device() -> None:
    """Wait for the calling thread's CUDA work, which the copy streams do not follow."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_inline(job: SaveJob) -> None:
    """The same job in the calling thread (a save that returns only once it is sealed)."""
    job.run(None, threading.Event())
