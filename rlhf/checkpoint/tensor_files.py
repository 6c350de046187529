"""Tensor files written, read and hashed in parallel, straight from and to the device.

A checkpoint of a 1.5B actor and critic is about 43 GB (bf16 weights, float32 master
weights and AdamW moments); one thread with `torch.save`, `torch.load` and a read-back
hash moves it at under 1 GB/s. Here every file is cut into `CHUNK`-byte pieces at fixed
offsets, and a pool of I/O threads each copies its piece off the device into a pinned
staging buffer, writes it with `pwrite` and hashes it from that buffer (no read back); a
read fills pieces with `preadv` and copies them onto the device (`rlhf.checkpoint.pieces`:
the pool, the buffers and the digests).

- Tensors go into safetensors files, the format HF and vLLM read (`write_safetensors`,
  `read_safetensors`).
- A nested state (DeepSpeed's optimizer state) is a small `torch.save` skeleton in which
  every tensor is a reference, next to a `<name>.safetensors` holding the tensors
  (`save_state`, `load_state`); both are read weights-only.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Optional

import torch

from rlhf.checkpoint.engine_state import load_weights_only
from rlhf.checkpoint.pieces import (CHUNK, combine, copy_stream, file_digest, hash_name, piece_digest, pread_into,
                                    pwrite_all, run_all, staging)

TENSOR_REF = "__tensor_ref__"  # a skeleton's placeholder key for a tensor stored beside it
DATA_SUFFIX = ".safetensors"  # a state skeleton `x` keeps its tensors in `x.safetensors`


# ---------------------------------------------------------------------------------
# safetensors, in parallel pieces
# ---------------------------------------------------------------------------------

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _layout(tensors: dict[str, torch.Tensor], metadata: Optional[dict]) -> tuple[bytes, list]:
    """(the header bytes, [(name, offset in the file, tensor)]) of a safetensors file; larger
    items first so that every tensor starts at a multiple of its item size."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, off, placed = {}, 0, []
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for k in order:
        t = tensors[k]
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor '{k}' has dtype {t.dtype}, which safetensors cannot store")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        placed.append((k, off, t))
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return head, [(k, len(head) + o, t) for k, o, t in placed]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None,
                      digest: Optional[str] = None, fsync: bool = True) -> str:
    """Write `tensors` (on any devices, final) as safetensors at `path`, in parallel pieces;
    returns the file's digest `digest` (default `hash_name()`), computed while writing."""
    digest = digest or hash_name()
    path = Path(path)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    head, placed = _layout(tensors, metadata)
    size = len(head) + sum(t.numel() * t.element_size() for _, _, t in placed)
    segments = [(0, len(head), torch.frombuffer(bytearray(head), dtype=torch.uint8))]
    segments += [(o, o + t.numel() * t.element_size(), _bytes_of(t)) for _, o, t in placed if t.numel()]
    pinned = any(t.is_cuda for _, _, t in placed)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)

        def piece(off: int) -> bytes:
            end = min(off + CHUNK, size)
            parts = _overlapping(segments, off, end)
            if len(parts) == 1 and not parts[0][2].is_cuda:  # inside one host tensor: write it directly
                a, b, src = parts[0]
                view = memoryview(src[a:b].numpy())
                pwrite_all(fd, view, off)
                return piece_digest(digest, view)
            with staging(pinned) as buf:
                stream = None
                pos = 0
                for a, b, src in parts:
                    if src.is_cuda and stream is None:
                        stream = copy_stream(src.device)
                    if src.is_cuda:
                        with torch.cuda.stream(stream):
                            buf[pos:pos + b - a].copy_(src[a:b], non_blocking=True)
                    else:
                        buf[pos:pos + b - a].copy_(src[a:b])
                    pos += b - a
                if stream is not None:
                    stream.synchronize()
                view = memoryview(buf.numpy())[:end - off]
                pwrite_all(fd, view, off)
                return piece_digest(digest, view)

        pieces = run_all(piece, range(0, size, CHUNK))
        if fsync:
            os.fsync(fd)  # the seal says the bytes are durable, not only in the page cache
    finally:
        os.close(fd)
    return combine(digest, pieces)


def _overlapping(segments: list, start: int, end: int) -> list:
    """[(first byte, end byte, source bytes)] of the segments inside [start, end), in file order."""
    out = []
    for s, e, src in segments:
        if e <= start or s >= end:
            continue
        out.append((max(start, s) - s, min(end, e) - s, src))
    return out


def read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return {"__size__": 8 + n, **json.loads(f.read(n))}


def read_safetensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of safetensors file `path`, placed on `device`, read in parallel pieces."""
    path, device = Path(path), torch.device(device)
    header = read_header(path)
    start = header.pop("__size__")
    header.pop("__metadata__", None)
    out, segments = {}, []
    for k, info in header.items():
        a, b = info["data_offsets"]
        t = torch.empty(info["shape"], dtype=_NAMES[info["dtype"]], device=device)
        out[k] = t
        if b > a:
            segments.append((start + a, start + b, _bytes_of(t)))
    segments.sort(key=lambda s: s[0])
    at = start
    for s, e, _ in segments:
        if s != at:
            raise ValueError(f"{path} is not a valid safetensors file: its tensor data has a gap or overlap at "
                             f"byte {at} (header offsets); rewrite it with safetensors or the checkpoint writer")
        at = e
    size = at
    fd = os.open(path, os.O_RDONLY)
    try:
        def piece(off: int) -> None:
            end = min(off + CHUNK, size)
            parts = _overlapping(segments, off, end)  # the data has no gaps: they fill [off, end)
            if len(parts) == 1 and device.type == "cpu":
                a, b, dst = parts[0]
                pread_into(fd, memoryview(dst[a:b].numpy()), off)
                return
            with staging(pinned=device.type == "cuda") as buf:
                pread_into(fd, memoryview(buf.numpy())[:end - off], off)
                stream = copy_stream(device) if device.type == "cuda" else None
                pos = 0
                for a, b, dst in parts:
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            dst[a:b].copy_(buf[pos:pos + b - a], non_blocking=True)
                    else:
                        dst[a:b].copy_(buf[pos:pos + b - a])
                    pos += b - a
                if stream is not None:
                    stream.synchronize()

        run_all(piece, range(start, size, CHUNK))
    finally:
        os.close(fd)
    return out


# ---------------------------------------------------------------------------------
# Nested states: a skeleton and its tensors
# ---------------------------------------------------------------------------------


def split_tensors(tree, out: dict[str, torch.Tensor]):
    """`tree` with every tensor replaced by `{TENSOR_REF: key}`, the tensors put in `out`."""
    if isinstance(tree, torch.Tensor):
        key = str(len(out))
        out[key] = tree
        return {TENSOR_REF: key}
    if isinstance(tree, dict):
        return {k: split_tensors(v, out) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(split_tensors(v, out) for v in tree)
    return tree


def join_tensors(tree, tensors: dict[str, torch.Tensor]):
    if isinstance(tree, dict):
        if set(tree) == {TENSOR_REF}:
            return tensors[tree[TENSOR_REF]]
        return {k: join_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(join_tensors(v, tensors) for v in tree)
    return tree


def data_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + DATA_SUFFIX)


def save_state(path: Path, tree, digest: Optional[str] = None) -> dict[Path, str]:
    """Write nested state `tree` as skeleton `path` and tensors `path.safetensors`; returns
    both files' digests."""
    digest = digest or hash_name()
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = split_tensors(tree, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = data_path(path)
    out = {data: write_safetensors(data, tensors, {"format": "pt"}, digest)}
    torch.save(skeleton, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    out[path] = file_digest(path, digest)
    return out


def load_state(path: Path, device: torch.device | str = "cpu"):
    """The nested state `save_state` wrote at `path`, its tensors on `device` (weights-only)."""
    skeleton = load_weights_only(str(path), map_location="cpu")
    return join_tensors(skeleton, read_safetensors(data_path(path), device))


def load_device(path: Path, device: torch.device) -> torch.device:
    """`device` when it is a GPU with room for the state's tensors (plus a margin), else the
    host: a restore should not fail for want of GPU memory that the engine will not keep."""
    if device.type != "cuda":
        return torch.device("cpu")
    header = read_header(data_path(path))
    need = max((v["data_offsets"][1] for k, v in header.items() if isinstance(v, dict) and "data_offsets" in v),
               default=0)
    free, _ = torch.cuda.mem_get_info(device)
    return device if free > 1.25 * need + (2 << 30) else torch.device("cpu")
