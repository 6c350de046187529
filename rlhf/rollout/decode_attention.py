"""Decode attention over the fast engine's static KV buffers, as one Triton kernel.

One query token per row, against that row's first `used[row]` keys. A program handles one
(row, KV head): it loads the G query heads that share the KV head as one (G, D) tile and
streams the row's keys and values once, in tiles of BLOCK_N, with an online softmax, so
each key is read once per KV head and the scores of the G heads come from one matrix
product per tile. Layout (the engine's): keys/values (rows * max_len, Hkv, D), row r's
position j at slot r * max_len + j; query (rows, Hq, D) with query head h reading KV head
h // G, as transformers' `repeat_kv` lays them out.
"""

from __future__ import annotations

import torch

from rlhf.rollout.triton_support import tl, triton

BLOCK_N = 64  # keys per tile


if triton is not None:

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, used_ptr, out_ptr, max_len, scale_log2,
                       HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                       D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        n = tl.load(used_ptr + row)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        heads = h * G + g
        q_off = row.to(tl.int64) * HQ * D + heads[:, None] * D + d[None, :]
        q_ok = (g < G)[:, None] & (d < D)[None, :]
        q = tl.load(q_ptr + q_off, mask=q_ok, other=0.0)
        base = row.to(tl.int64) * max_len * HKV * D + h * D
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for start in range(0, n, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            ok = j < n
            kv_off = base + j[:, None] * (HKV * D) + d[None, :]
            kv_ok = ok[:, None] & (d < D)[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2  # (G_PAD, BLOCK_N), log2 units
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=q_ok)


def triton_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, used: torch.Tensor, max_len: int,
                  scale: float) -> torch.Tensor:
    """q (rows, Hq, D), keys/values (rows * max_len, Hkv, D), used (rows,) int32 -> (rows, Hq, D)."""
    rows, hq, d = q.shape
    hkv = keys.shape[1]
    if hq % hkv:
        raise ValueError(f"triton decode attention needs Hq divisible by Hkv, got Hq={hq}, Hkv={hkv}")
    g = hq // hkv
    out = torch.empty_like(q)
    _decode_kernel[(rows, hkv)](q.contiguous(), keys, values, used, out, max_len, scale * 1.4426950408889634,
                                HQ=hq, HKV=hkv, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d,
                                D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_N=BLOCK_N, num_warps=4, num_stages=3)
    return out
