"""Fused forms of the small per-layer operations of a decode step, for the fast rollout engine.

At 1024 rows a decode step of a 1.5B model spends as long in RMSNorm, rotary embedding and
the SiLU gate (about 25 elementwise kernels per layer, each a round trip through memory) as
in its matrix products. `fused_decode_ops(model)` swaps, for the duration of a `with`
block, three of them for one Triton kernel each, with the same rounding steps as the
transformers code they replace (every bf16 result of the original is rounded the same way):

- `*RMSNorm` modules (`weight`, `variance_epsilon`): fp32 mean of squares, rsqrt, cast,
  times the weight;
- `*MLP` modules with `gate_proj`/`up_proj`/`down_proj` and a SiLU: silu(gate) * up;
- the modelling module's `apply_rotary_pos_emb`, for one query position per row (decode);
  prefill keeps the original.

Modules of other shapes keep their own forward. Everything is restored on exit.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import torch

from rlhf.rollout.triton_support import tl, triton


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, n_cols, eps,
                         CAST_TY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        var = tl.sum(x * x, 0) / n_cols
        normed = (x * (1.0 / tl.sqrt(var + eps))).to(CAST_TY).to(tl.float32)  # hidden_states.to(input_dtype)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        g = tl.load(g_ptr + i, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + i, mask=ok, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # act_fn(gate) in its dtype
        tl.store(out_ptr + i, (act * u).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_heads(x_ptr, out_ptr, c1, c2, s1, s2, row, stride_b, stride_h, n_heads,
                    HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
        h = tl.arange(0, H_PAD)[:, None]
        j = tl.arange(0, HALF_PAD)[None, :]
        ok = (h < n_heads) & (j < HALF)
        src = x_ptr + row.to(tl.int64) * stride_b + h * stride_h + j
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        ty = out_ptr.dtype.element_ty
        # q * cos + rotate_half(q) * sin with rotate_half(q) = cat(-x2, x1), each product rounded
        lo = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
        hi = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
        dst = out_ptr + row.to(tl.int64) * n_heads * 2 * HALF + h * 2 * HALF + j
        tl.store(dst, lo.to(ty), mask=ok)
        tl.store(dst + HALF, hi.to(ty), mask=ok)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, sq_b, sq_h, sk_b, sk_h, sc_b, ss_b,
                     n_q, n_k, HALF: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
                     HALF_PAD: tl.constexpr):
        row = tl.program_id(0)
        j = tl.arange(0, HALF_PAD)[None, :]
        jm = j < HALF
        cb = cos_ptr + row.to(tl.int64) * sc_b + j
        sb = sin_ptr + row.to(tl.int64) * ss_b + j
        c1 = tl.load(cb, mask=jm, other=0.0).to(tl.float32)
        c2 = tl.load(cb + HALF, mask=jm, other=0.0).to(tl.float32)
        s1 = tl.load(sb, mask=jm, other=0.0).to(tl.float32)
        s2 = tl.load(sb + HALF, mask=jm, other=0.0).to(tl.float32)
        _rope_heads(q_ptr, qo_ptr, c1, c2, s1, s2, row, sq_b, sq_h, n_q, HALF, HQ_PAD, HALF_PAD)
        _rope_heads(k_ptr, ko_ptr, c1, c2, s1, s2, row, sk_b, sk_h, n_k, HALF, HK_PAD, HALF_PAD)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: weight * (x / rms(x)).to(x.dtype), over the last dim."""
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    cast = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), n, eps, CAST_TY=cast,
                                     BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 2048 else 4)
    return out.view(shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the silu rounded to the input dtype first (as `act_fn(gate) * up`)."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n, block = gate.numel(), 4096
    _silu_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block, num_warps=8)
    return out


def rope_one_position(q, k, cos, sin):
    """`apply_rotary_pos_emb` for q (B, Hq, 1, D), k (B, Hk, 1, D), cos/sin (B, 1, D)."""
    b, hq, _, d = q.shape
    hk = k.shape[1]
    qo = torch.empty((b, hq, 1, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((b, hk, 1, d), dtype=k.dtype, device=k.device)
    half = d // 2
    _rope_kernel[(b,)](q, k, cos, sin, qo, ko, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       cos.stride(0), sin.stride(0), hq, hk, HALF=half, HQ_PAD=triton.next_power_of_2(hq),
                       HK_PAD=triton.next_power_of_2(hk), HALF_PAD=triton.next_power_of_2(half), num_warps=4)
    return qo, ko


def _rms_forward(module, hidden_states):
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def _mlp_forward(module, x):
    return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))


def _rope_with_fallback(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, unsqueeze_dim: int = 1, **kwargs):
        fits = (not args and not kwargs and unsqueeze_dim == 1 and q.dim() == 4 and q.shape[2] == 1
                and cos.dim() == 3 and cos.shape[1] == 1 and q.shape[-1] % 2 == 0 and q.stride(-1) == 1
                and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.shape == sin.shape)
        if fits:
            return rope_one_position(q, k, cos, sin)
        return original(q, k, cos, sin, *args, unsqueeze_dim=unsqueeze_dim, **kwargs)

    apply_rotary_pos_emb.rlhf_fused = True
    return apply_rotary_pos_emb


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


@contextmanager
def fused_decode_ops(model: torch.nn.Module) -> Iterator[dict]:
    """Within the block, the model's RMSNorms, SiLU MLPs and rotary embedding run as the
    kernels above; yields counts of what was swapped."""
    from functools import partial

    swapped: list[torch.nn.Module] = []
    counts = {"rms_norm": 0, "mlp": 0, "rope_modules": 0}
    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm") and isinstance(getattr(mod, "weight", None), torch.Tensor) \
                and hasattr(mod, "variance_epsilon") and "forward" not in mod.__dict__:
            mod.forward = partial(_rms_forward, mod)
            swapped.append(mod)
            counts["rms_norm"] += 1
        elif name.endswith("MLP") and all(hasattr(mod, a) for a in ("gate_proj", "up_proj", "down_proj")) \
                and _is_silu(getattr(mod, "act_fn", None)) and "forward" not in mod.__dict__:
            mod.forward = partial(_mlp_forward, mod)
            swapped.append(mod)
            counts["mlp"] += 1
    ropes = {}
    for mod in model.modules():
        owner = sys.modules.get(type(mod).__module__)
        fn = getattr(owner, "apply_rotary_pos_emb", None)
        if owner is not None and callable(fn) and not getattr(fn, "rlhf_fused", False) and owner not in ropes:
            ropes[owner] = fn
    for owner, fn in ropes.items():
        owner.apply_rotary_pos_emb = _rope_with_fallback(fn)
    counts["rope_modules"] = len(ropes)
    try:
        yield counts
    finally:
        for mod in swapped:
            del mod.forward
        for owner, fn in ropes.items():
            owner.apply_rotary_pos_emb = fn
