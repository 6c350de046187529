"""Files read, written and hashed in parallel pieces, through a shared pool of I/O threads.

Every file is cut into `CHUNK`-byte pieces at fixed offsets; a pool of `IO_THREADS`
threads moves the pieces with `pwrite` and `preadv`, each through a `CHUNK`-byte host
staging buffer (pinned for device copies) kept between calls, and copies to and from a
GPU on a per-thread stream.

A file's digest is a tree (`<hash>/64MiB`): the hash of its pieces' hashes, so pieces are
hashed in parallel as they are written and when verified; `file_digest` also checks the
plain streaming digests that earlier manifests name.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

CHUNK = 64 << 20  # bytes per piece: the unit of parallel writing, reading and hashing


def _io_threads() -> int:
    """`RLHF_IO_THREADS` if set, else the cores this process may use, at most 8."""
    if os.environ.get("RLHF_IO_THREADS"):
        return max(1, int(os.environ["RLHF_IO_THREADS"]))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


IO_THREADS = _io_threads()
_POOL: Optional[ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="tensor-io")
        return _POOL


def run_all(fn, items) -> list:
    """`fn(item)` for every item on the I/O pool; the first error is raised once all are done."""
    futures = [_pool().submit(fn, it) for it in items]
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [f.result() for f in futures]


# ---------------------------------------------------------------------------------
# Staging buffers, kept between calls (pinned ones are slow to allocate)
# ---------------------------------------------------------------------------------


_FREE: dict[bool, "queue.SimpleQueue[torch.Tensor]"] = {True: queue.SimpleQueue(), False: queue.SimpleQueue()}
_MADE = {True: 0, False: 0}
_MADE_LOCK = threading.Lock()


class staging:
    """A `CHUNK`-byte uint8 host buffer for the duration of a `with` (at most `IO_THREADS` of each kind exist)."""

    def __init__(self, pinned: bool):
        self.pinned = pinned and torch.cuda.is_available()

    def __enter__(self) -> torch.Tensor:
        q = _FREE[self.pinned]
        with _MADE_LOCK:
            make = q.empty() and _MADE[self.pinned] < IO_THREADS
            if make:
                _MADE[self.pinned] += 1
        self.buf = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=self.pinned) if make else q.get()
        return self.buf

    def __exit__(self, *exc) -> None:
        _FREE[self.pinned].put(self.buf)


_LOCAL = threading.local()


def copy_stream(device: torch.device):
    """This thread's copy stream on `device`."""
    streams = getattr(_LOCAL, "streams", None)
    if streams is None:
        streams = _LOCAL.streams = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)
    return streams[device]


def pread_into(fd: int, view: memoryview, off: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], off + done)
        if n == 0:
            raise EOFError(f"file ended {len(view) - done} bytes early at offset {off + done}")
        done += n


def pwrite_all(fd: int, view: memoryview, off: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], off + done)


# ---------------------------------------------------------------------------------
# Digests
# ---------------------------------------------------------------------------------

TREE = "/64MiB"  # suffix of a tree digest's name


def hash_name() -> str:
    """The digest new manifests use: a tree over `CHUNK`-byte pieces of xxh3_128 (about 8-14
    GB/s on one core) where xxhash is installed, else of blake2b."""
    return ("xxh3_128" if importlib.util.find_spec("xxhash") is not None else "blake2b") + TREE


def _hasher(name: str):
    base = name[: -len(TREE)] if name.endswith(TREE) else name
    if base == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if base == "blake2b":
        import hashlib

        return hashlib.blake2b(digest_size=16)
    raise ValueError(f"unknown checkpoint digest '{name}' (this version knows xxh3_128 and blake2b, "
                     f"plain or with {TREE})")


def piece_digest(name: str, data) -> bytes:
    h = _hasher(name)
    h.update(data)
    return h.digest()


def combine(name: str, pieces: list[bytes]) -> str:
    h = _hasher(name)
    for p in pieces:
        h.update(p)
    return h.hexdigest()


def file_digest(path: Path, name: str) -> str:
    """The hex digest `name` of a file's bytes (tree digests hashed in parallel pieces)."""
    path = Path(path)
    if not name.endswith(TREE):
        h, buf = _hasher(name), bytearray(16 << 20)
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
        return h.hexdigest()
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        def piece(off: int) -> bytes:
            with staging(pinned=False) as buf:
                n = min(CHUNK, size - off)
                view = memoryview(buf.numpy())[:n]
                pread_into(fd, view, off)
                return piece_digest(name, view)

        return combine(name, run_all(piece, range(0, size, CHUNK)))
    finally:
        os.close(fd)
