"""Micro-batches by token budget, sequence packing, and padding.

Packing: sequences are concatenated into one row (1, T_total) with `position_ids` that
restart at 0 for each sequence. Transformers (sdpa or eager attention, CPU included)
derives a block-diagonal causal mask from such position ids when `attention_mask=None`
and there is no KV cache, so the forward must pass `use_cache=False`
(`packed_forward_kwargs` does): with the cache on, the restart is ignored and the
logits are silently wrong. `block_causal_mask` builds the equivalent explicit 4D mask
for attention backends that do not look at position ids.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import torch


def _lpt(items: list[tuple[int, int]], k: int) -> list[tuple[int, list[int]]]:
    """Longest-first greedy into k bins, each item to the currently lightest bin: [(total, [index, ...])]."""
    heap = [(0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    totals = [0] * k
    for length, index in items:
        total, b = heapq.heappop(heap)
        bins[b].append(index)
        totals[b] = total + length
        heapq.heappush(heap, (totals[b], b))
    return list(zip(totals, bins))


def _flatten_tree(tree: object) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, tuple):
            stack.extend(node)
        elif node is not None:
            out.append(node)
    return out


def _karmarkar_karp(items: list[tuple[int, int]], k: int) -> list[tuple[int, list[int]]]:
    """Largest differencing method for k-way balanced partitions: [(total, [index, ...])].

    Each item starts as a k-way partial partition; the two with the largest spread are
    merged, heaviest part with lightest part, until one partition is left. Parts hold
    their indices as a tree of pairs so a merge costs O(k), not O(items).
    """
    partials = [[(length, index)] + [(0, None)] * (k - 1) for length, index in items]
    return _differencing(partials)


def _differencing(partials: list[list[tuple[int, object]]]) -> list[tuple[int, list[int]]]:
    """Merge k-way partial partitions (each a list of k (total, tree) parts, heaviest first),
    the two of largest spread first, heaviest part with lightest part, until one is left."""
    heap = [(-(p[0][0] - (p[-1][0] if len(p) > 1 else 0)), order, p) for order, p in enumerate(partials)]
    heapq.heapify(heap)
    order = len(partials)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)  # both sorted heaviest part first
        merged = sorted(((ta + tb, (ia, ib)) for (ta, ia), (tb, ib) in zip(a, reversed(b))),
                        key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), order, merged))
        order += 1
    return [(total, _flatten_tree(tree)) for total, tree in heap[0][2]]


def equal_count_partition(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Indices into `lengths` in k parts of exactly len(lengths) / k indices each, with
    near-equal totals; each part in ascending index order. Deterministic (ties by index).

    The better (lighter heaviest part, then smaller spread) of two partitions, then improved
    by swaps between the heaviest and the lightest part: Karmarkar-Karp differencing on k-way
    partial partitions built from each run of k consecutive items in longest-first order (every
    part takes one item of each run, so counts stay equal), and longest-first into the lightest
    part that still has room.
    """
    n = len(lengths)
    if k <= 0 or n % k:
        raise ValueError(f"{n} items cannot be split into {k} parts of equal count")
    if any(x < 0 for x in lengths):
        raise ValueError("lengths must be >= 0")
    items = sorted(((int(x), i) for i, x in enumerate(lengths)), key=lambda x: (-x[0], x[1]))
    if n == 0:
        return [[] for _ in range(k)]
    kk = [b for _, b in _differencing([items[j:j + k] for j in range(0, n, k)])]
    room, totals = n // k, [0] * k
    lpt: list[list[int]] = [[] for _ in range(k)]
    for length, index in items:
        b = min((b for b in range(k) if len(lpt[b]) < room), key=lambda b: (totals[b], b))
        lpt[b].append(index)
        totals[b] += length
    best = min((kk, lpt), key=lambda parts: _spread_key(parts, lengths))
    return [sorted(p) for p in _swap_refine(best, lengths)]


def _spread_key(parts: list[list[int]], lengths: Sequence[int]) -> tuple[int, int]:
    totals = [sum(int(lengths[i]) for i in p) for p in parts]
    return max(totals), max(totals) - min(totals)


def _swap_refine(parts: list[list[int]], lengths: Sequence[int], max_rounds: int = 64) -> list[list[int]]:
    """Swap one item of the heaviest part for one of the lightest while that lowers their
    difference (counts unchanged); stops at a local optimum or after `max_rounds` swaps."""
    parts = [list(p) for p in parts]
    totals = [sum(int(lengths[i]) for i in p) for p in parts]
    for _ in range(max_rounds):
        h = max(range(len(parts)), key=lambda b: (totals[b], -b))
        lo = min(range(len(parts)), key=lambda b: (totals[b], b))
        gap = totals[h] - totals[lo]
        if gap <= 1:
            break
        best, pick = gap, None
        light = sorted(parts[lo], key=lambda i: (int(lengths[i]), i))
        light_len = [int(lengths[i]) for i in light]
        for a in parts[h]:
            # the best partner b has lengths[b] closest to lengths[a] - gap / 2
            want = int(lengths[a]) - gap / 2
            j = bisect.bisect_left(light_len, want)
            for jj in (j - 1, j):
                if 0 <= jj < len(light):
                    d = int(lengths[a]) - light_len[jj]
                    if 0 < d < gap and abs(gap - 2 * d) < best:
                        best, pick = abs(gap - 2 * d), (a, light[jj], d)
        if pick is None:
            break
        a, b, d = pick
        parts[h][parts[h].index(a)] = b
        parts[lo][parts[lo].index(b)] = a
        totals[h] -= d
        totals[lo] += d
    return parts


def dynamic_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Partition sequence indices into micro-batches of at most `max_tokens` tokens each.

    Balanced: for the smallest number of micro-batches k (searched upward from a lower
    bound) for which a balanced partition fits, the better (smaller spread) of two
    partitions that fits is used: Karmarkar-Karp differencing, and longest-first into the
    lightest micro-batch (which keeps any two micro-batches within the longest sequence
    of each other). A sequence longer than `max_tokens` gets a micro-batch of its own,
    placed last. Every index appears exactly once.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0 (actor.ppo_max_token_len_per_gpu), got {max_tokens}")
    if any(n < 0 for n in lengths):
        raise ValueError("sequence lengths must be >= 0")
    oversize = [[i] for i, n in enumerate(lengths) if n > max_tokens]
    items = sorted(((int(n), i) for i, n in enumerate(lengths) if n <= max_tokens), key=lambda x: (-x[0], x[1]))
    if not items:
        return oversize
    # Lower bounds on k: the token total, and sequences over half the budget never share.
    k = max(1, math.ceil(sum(n for n, _ in items) / max_tokens), sum(2 * n > max_tokens for n, _ in items))
    while True:
        fitting = [p for p in (_karmarkar_karp(items, k), _lpt(items, k))
                   if all(total <= max_tokens for total, _ in p)]
        if fitting:
            break
        k += 1  # terminates: with k == len(items) every sequence is alone and fits
    best = min(fitting, key=lambda p: max(t for t, _ in p) - min(t for t, _ in p))
    return [sorted(b, key=lambda i: (-lengths[i], i)) for _, b in best if b] + oversize


@dataclass
class PackedBatch:
    """Sequences concatenated into one row.

    input_ids: (1, T_total) long; position_ids: (1, T_total) long, restarting at 0 per
    sequence; cu_seqlens: (N+1,) int32 cumulative lengths (flash-attn's varlen format);
    lengths: the N sequence lengths.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: list[int]

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths, default=0)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


def pack_sequences(seqs: Sequence[Sequence[int]] | Sequence[torch.Tensor]) -> PackedBatch:
    """1D token sequences -> one packed row (see `PackedBatch`)."""
    tensors = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    lengths = [int(t.numel()) for t in tensors]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    input_ids = torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.long)
    positions = [torch.arange(n, dtype=torch.long) for n in lengths]
    position_ids = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
    return PackedBatch(input_ids[None], position_ids[None], cu, lengths)


def unpack(packed_values: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """(1, T_total, ...) or (T_total, ...) values -> per-sequence tensors (len_i, ...)."""
    total = int(cu_seqlens[-1])
    values = packed_values
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == total:
        values = values[0]
    if values.shape[0] != total:
        raise ValueError(f"packed values have shape {tuple(packed_values.shape)}, expected (1, {total}, ...) or "
                         f"({total}, ...) to match cu_seqlens")
    bounds = cu_seqlens.tolist()
    return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def packed_forward_kwargs(packed: PackedBatch) -> dict:
    """Keyword arguments for a transformers causal LM forward over a packed row."""
    return {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "use_cache": False}


def block_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask (1, 1, T, T): 0 where query i may attend key j (same sequence, j <= i), else dtype's min."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (T,) sequence of each token
    pos = torch.arange(seq.numel())
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def pad_sequences(seqs: Sequence[Sequence[int]] | Sequence[torch.Tensor], pad_id: int,
                  side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences -> (input_ids (B, T) long, attention_mask (B, T) long), T = longest sequence."""
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    tensors = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    width = max((t.numel() for t in tensors), default=0)
    input_ids = torch.full((len(tensors), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(tensors), width), dtype=torch.long)
    for i, t in enumerate(tensors):
        n = t.numel()
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        input_ids[i, cols] = t
        attention_mask[i, cols] = 1
    return input_ids, attention_mask
