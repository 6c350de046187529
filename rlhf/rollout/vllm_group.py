"""Which ranks share one vLLM engine, and the prompts that cross between them.

With `rollout.tensor_model_parallel_size` T > 1 under torchrun (W ranks, W divisible by T),
ranks [g*T, (g+1)*T) form tensor-parallel group g and share one engine: each rank holds one of
its T workers in its own process (vLLM's `external_launcher` backend, as verl runs vLLM beside
its trainer), so W/T engines of T GPUs serve the W ranks. vLLM lays out its own groups the same
way (an outer data-parallel axis over consecutive tensor-parallel ranks), so these groups are the
ones its workers all-reduce in.

The workers of one engine each run their own scheduler and sampler on all-gathered logits, so they
must be given the same requests in the same order and sample from the same random state: each
rank's prompts and rollout seed are gathered within the group, every member generates the whole
group's prompts under the first member's seed, and each keeps its own rows. When every member
holds the same prompts (validation: each rank scores the whole validation set) they are
generated once.

One process with T > 1 (a rollout task on T GPUs) starts the T workers itself (vLLM's "mp"
backend); T = 1 runs one worker in this process ("uni"), one engine per rank.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass(frozen=True)
class EngineGroup:
    rank: int  # this process's rank in the torchrun world
    world: int  # ranks in the world
    size: int  # rollout.tensor_model_parallel_size: workers (GPUs) of one engine

    @property
    def first(self) -> int:
        """The group's first rank (its seed is the group's)."""
        return self.rank - self.rank % self.size if self.shared else self.rank

    @property
    def shared(self) -> bool:
        """Whether this rank shares its engine with other ranks (external launcher)."""
        return self.size > 1 and self.world > 1

    @property
    def backend(self) -> str:
        """vLLM's `distributed_executor_backend` for this layout."""
        if self.size == 1:
            return "uni"
        return "external_launcher" if self.shared else "mp"

    def members(self) -> list[int]:
        return list(range(self.first, self.first + self.size)) if self.shared else [self.rank]


def engine_group(tensor_parallel_size: int) -> EngineGroup:
    """This process's place in the engine layout (the torch.distributed world, or one process)."""
    initialized = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    if world > 1 and tensor_parallel_size > 1 and world % tensor_parallel_size:
        raise ValueError(f"rollout.tensor_model_parallel_size={tensor_parallel_size} must divide the {world} ranks "
                         "(trainer.nnodes x trainer.n_gpus_per_node): each group of that many ranks shares one "
                         "vLLM engine")
    return EngineGroup(rank, world, tensor_parallel_size)


class PromptExchange:
    """Gathers the prompts of a tensor-parallel group (a no-op for an engine of its own)."""

    def __init__(self, group: EngineGroup):
        self.group = group
        self.pg: Optional[dist.ProcessGroup] = None
        if group.shared:
            # new_group is collective over the world: every rank creates every group, in order.
            for first in range(0, group.world, group.size):
                pg = dist.new_group(list(range(first, first + group.size)), backend="gloo")
                if first == group.first:
                    self.pg = pg

    def gather(self, prompts: list[list[int]], seed: Optional[int]
               ) -> tuple[list[list[int]], Optional[int], slice]:
        """(the group's prompts in member order, the seed every member samples with, this rank's
        rows of them). An unseeded call still samples from one seed drawn by the first member."""
        if self.pg is None:
            return prompts, seed, slice(0, len(prompts))
        mine = (prompts, seed if seed is not None else random.SystemRandom().randrange(2 ** 31))
        parts: list = [None] * self.group.size
        dist.all_gather_object(parts, mine, group=self.pg)
        group_seed = parts[0][1]
        if all(p[0] == prompts for p in parts):
            return prompts, group_seed, slice(0, len(prompts))
        index = self.group.rank - self.group.first
        start = sum(len(p[0]) for p in parts[:index])
        return [p for part, _ in parts for p in part], group_seed, slice(start, start + len(prompts))
