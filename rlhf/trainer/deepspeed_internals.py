"""The DeepSpeed internals the trainer touches, each in one function with the reason it is
needed; no other module of `rlhf` reads or writes a private DeepSpeed name.

DeepSpeed is imported only by the functions that need it (or found in `sys.modules`: a
cache that was never filled needs no reset).
"""

from __future__ import annotations

import sys
from typing import Callable

# deepspeed.utils.groups' cached process groups, rebuilt on demand when set to None
_CACHED_GROUPS = ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
                  "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP")


def consolidated_16bit_state_dict(engine) -> dict:
    """A ZeRO-3 engine's module weights gathered in memory (rank 0 gets them). The public
    `save_16bit_model` runs this same gather but writes the result with torch.save; the
    checkpoint needs the tensors themselves (checked for non-finite values, then written as
    safetensors by the checkpoint writer)."""
    return engine._zero3_consolidated_16bit_state_dict()


def forget_comm_backend() -> None:
    """Drop DeepSpeed's cached communication backend (`deepspeed.comm.comm.cdb`). It keeps the
    process group it first saw; after that group was destroyed (an in-process vLLM engine's
    shutdown does), DeepSpeed would fail with "Group ... is not registered" instead of
    adopting the new one. There is no public reset."""
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and getattr(comm, "cdb", None) is not None:
        comm.cdb = None


def drop_cached_groups(is_registered: Callable[[object], bool]) -> None:
    """Drop the sub-groups `deepspeed.utils.groups` cached from an earlier world that
    `is_registered` says the current one does not know, so the next engine builds fresh
    ones. DeepSpeed reads these module globals and rebuilds a group that is None; it has no
    public way to forget them."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name in _CACHED_GROUPS:
        group = getattr(groups, name, None)
        if group is not None and not is_registered(group):
            setattr(groups, name, None)


def mark_op_incompatible(op: str) -> None:
    """Tell DeepSpeed that op `op` cannot be built here (`deepspeed.ops.__compatible_ops__`),
    so it falls back instead of starting a JIT build: the only switch DeepSpeed reads before
    it builds the CPU shared-memory communication op."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[op] = False
