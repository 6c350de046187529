"""Variable-length attention over packed sequences, for the trainer's packed forward
(`rlhf.trainer.forward`) and the rollout engine's prefill and decode
(`rlhf.rollout.fast_decode`).

Packed layout: q (T, Hq, D), k/v (T, Hkv, D) with Hq a multiple of Hkv; sequence i holds
rows cu[i]:cu[i+1]; query head h reads KV head h // (Hq / Hkv).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as nnf


def flash_attention_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                           seqused_k: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Flash-attention's variable-length kernel: sequence i's queries cu_q[i]:cu_q[i+1] attend
    to keys cu_k[i]:cu_k[i+1], or to the first seqused_k[i] keys from cu_k[i] when given.
    Dropout 0, no debug mask; returns the attention output (Tq, Hq, D)."""
    # A private aten op: the GPU image's torch (2.8) has no public variable-length flash-attention
    # entry point; later releases' `torch.nn.attention.varlen.varlen_attn` calls this same op
    # (`varlen_flash` prefers it where it takes grouped KV heads). The one call site in rlhf.
    extra = {} if seqused_k is None else {"seqused_k": seqused_k}
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                  scale=scale, **extra)
    return out[0]


def varlen_flash(q, k, v, cu, max_len: int, scale: float) -> torch.Tensor:
    """Causal flash-attention over packed sequences: q (T, Hq, D), k/v (T, Hkv, D) -> (T, Hq, D).

    torch's `varlen_attn` where it takes a scale and grouped KV heads, else the aten flash
    kernel it wraps (which has its own backward and accepts grouped KV heads)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
        import inspect

        if "enable_gqa" in inspect.signature(varlen_attn).parameters:
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0),
                               enable_gqa=q.shape[1] != k.shape[1])
    except ImportError:
        pass
    return flash_attention_varlen(q, k, v, cu, cu, max_len, max_len, scale, causal=True)


def varlen_reference(q, k, v, cu_host: list[int], scale: float) -> torch.Tensor:
    """The same attention sequence by sequence with SDPA (CPU, or where flash is unavailable)."""
    groups = q.shape[1] // k.shape[1]
    out = []
    for s, e in zip(cu_host[:-1], cu_host[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))  # (H, L, D)
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        out.append(nnf.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(out)
