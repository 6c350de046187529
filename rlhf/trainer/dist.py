"""Process-group set-up and the few collectives the trainer needs.

Under torchrun the environment names rank and world size; in a plain process we
create a one-rank group ourselves so DeepSpeed never looks for MPI.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from rlhf.trainer.deepspeed_internals import drop_cached_groups, forget_comm_backend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(name: str = "auto") -> torch.device:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_distributed(device: torch.device) -> tuple[int, int]:
    """Initialise (or reuse) the default process group; returns (rank, world_size)."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if world == 1:  # a group made in this process (an in-process vLLM engine's): no launcher set these
            for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(k, v)
        return rank, world
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if device.type == "cuda" else "gloo"
    forget_comm_backend()  # a group destroyed since (an in-process vLLM engine's shutdown) is not reused
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def drop_stale_deepspeed_groups() -> None:
    """DeepSpeed caches sub-groups of the first world it saw (`deepspeed.utils.groups`); after
    that world was destroyed and a new default group made, those handles are invalid. Drop
    any that the current world does not know, so the next engine builds fresh ones."""
    drop_cached_groups(_registered)


def _registered(group) -> bool:
    try:
        dist.get_global_rank(group, 0)  # what DeepSpeed calls; raises for an unregistered group
        return True
    except (ValueError, RuntimeError):
        return False


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _comm_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    if world()[1] == 1:
        return t
    out = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(out, op=op)
    return out.to(t.device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    return _all_reduce(t, dist.ReduceOp.SUM)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    return _all_reduce(t, dist.ReduceOp.MAX)


def mean_across_ranks(values: dict[str, float]) -> dict[str, float]:
    """Average a flat metrics dict over ranks (same keys on every rank)."""
    if world()[1] == 1 or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    t = all_reduce_sum(t) / world()[1]
    return dict(zip(keys, t.tolist()))


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()


def shutdown() -> None:
    """At the end of a process that ran collectives: wait for every rank, then destroy the
    default process group. A process that exits with the group alive can abort at
    interpreter exit (gloo's threads: "terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()


def broadcast_object(obj):
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj` (picklable), in rank order."""
    ws = world()[1]
    if ws == 1:
        return [obj]
    out = [None] * ws
    dist.all_gather_object(out, obj)
    return out


def masked_mean_global(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over all ranks' masked entries (0-dim), as one process would compute it
    over the whole batch."""
    valid = mask.bool()
    stats = torch.stack([torch.where(valid, x, torch.zeros_like(x)).sum(), valid.sum()]).double()
    s, n = all_reduce_sum(stats).tolist()
    return torch.tensor(s / max(n, 1.0), dtype=x.dtype, device=x.device)


def masked_whiten_global(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten with mean and variance over all ranks' masked entries, so that a sharded batch
    gets exactly the advantages the whole batch would get in one process."""
    stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()
    s, ss, n = all_reduce_sum(stats).tolist()
    n = max(n, 1.0)
    mean = s / n
    var = max(ss / n - mean * mean, 0.0) * (n / max(n - 1.0, 1.0))  # unbiased, as torch.var
    return (x - mean) * torch.rsqrt(torch.tensor(var + eps, dtype=x.dtype)) * mask


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate a same-shaped tensor from every rank along dim 0."""
    _, ws = world()
    if ws == 1:
        return t
    src = t.detach().to(_comm_device()).contiguous()
    parts = [torch.zeros_like(src) for _ in range(ws)]
    dist.all_gather(parts, src)
    return torch.cat(parts).to(t.device)
