"""The balanced split of a round's rows over data-parallel ranks (`trainer.balance_batch`):
index arithmetic on the rows' token counts, cut per step and per global PPO mini-batch into
parts of equal row count and near-equal tokens (`rlhf.data.batching.equal_count_partition`),
with GRPO's prompt groups kept whole. `rlhf.round.stages.shard_for_update` applies it to a
scored table and falls back to the contiguous split when no equal split exists.
"""

from __future__ import annotations

from typing import Sequence
from rlhf.data.batching import equal_count_partition


def balanced_rows(lengths: Sequence[int], steps: int, world: int, chunk_rows: int,
                  group_ids: Sequence | None = None) -> tuple[list[list[int]] | None, str]:
    """Each rank's row indices, or (None, why) when no equal-count split exists.

    Rows are `steps` blocks of equal size; each block is cut into chunks of `chunk_rows`
    rows (one global mini-batch), or taken whole when its units do not divide that way,
    and each chunk's units go to `world` parts of equal unit count and near-equal tokens
    (`equal_count_partition`). A unit is a row, or with `group_ids` a run of consecutive
    rows with the same id (all units of a chunk of one size, so parts get equal rows).
    Rank r's rows: part r of every chunk in turn, each part in the original row order."""
    n = len(lengths)
    if steps <= 0 or n % steps:
        return None, f"{n} rows do not make {steps} equal step blocks"
    per_step = n // steps
    out: list[list[int]] = [[] for _ in range(world)]
    for s in range(steps):
        units = _units(range(s * per_step, (s + 1) * per_step), group_ids)
        chunks = _chunks(units, chunk_rows, world)
        if chunks is None:
            chunks = _chunks(units, per_step, world)
        if chunks is None:
            what = "prompt groups" if group_ids is not None else "rows"
            return None, (f"the {len(units)} {what} of a step ({per_step} rows) cannot be split into {world} "
                          f"parts of equal row count")
        for chunk in chunks:
            weights = [sum(int(lengths[i]) for i in u) for u in chunk]
            for r, part in enumerate(equal_count_partition(weights, world)):
                out[r].extend(i for u in part for i in chunk[u])
    return out, ""


def _units(rows: range, group_ids: Sequence | None) -> list[list[int]]:
    if group_ids is None:
        return [[i] for i in rows]
    units: list[list[int]] = []
    for i in rows:
        if units and group_ids[i] == group_ids[units[-1][-1]]:
            units[-1].append(i)
        else:
            units.append([i])
    return units


def _chunks(units: list[list[int]], rows: int, world: int) -> list[list[list[int]]] | None:
    """`units` cut into consecutive chunks of `rows` rows each, every chunk's unit count
    divisible by `world` and its units of one size; None when that cannot be done."""
    chunks, cur, size = [], [], 0
    for u in units:
        cur.append(u)
        size += len(u)
        if size > rows:
            return None
        if size == rows:
            chunks.append(cur)
            cur, size = [], 0
    if cur or not chunks:
        return None
    for c in chunks:
        if len(c) % world or len({len(u) for u in c}) != 1:
            return None
    return chunks
