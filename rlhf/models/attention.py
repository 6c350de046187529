"""Variable-length attention over packed sequences, for the trainer's packed forward
(`rlhf.trainer.forward`) and the rollout engine's prefill and decode
(`rlhf.rollout.fast_decode`).

Packed layout: q (T, Hq, D), k/v (T, Hkv, D) with Hq a multiple of Hkv; sequence i holds
rows cu[i]:cu[i+1]; query head h reads KV head h // (Hq / Hkv).

`use_varlen_attention` switches a transformers model to the `rlhf_varlen` attention
function: these kernels for packed rows (position ids restarting per sequence), SDPA
for every other call.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as nnf

VARLEN_ATTENTION = "rlhf_varlen"


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


# ---------------------------------------------------------------------------------------------
# The transformers attention function of packed rows
# ---------------------------------------------------------------------------------------------


_FLASH_OK: dict[str, bool] = {}
_CU_CACHE: dict = {}


def _cu_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """cu_seqlens (N+1,) int32 and the longest length of position ids (1, T) that restart at 0
    per sequence; computed once per forward (every layer sees the same tensor object)."""
    ref = _CU_CACHE.get("ref")
    if ref is None or ref() is not position_ids:
        pos = position_ids[0]
        starts = (pos == 0).nonzero().flatten().tolist()
        bounds = starts + [pos.numel()] if starts and starts[0] == 0 else [0] + starts + [pos.numel()]
        cu = torch.tensor(bounds, dtype=torch.int32, device=pos.device)
        _CU_CACHE["ref"] = weakref.ref(position_ids)
        _CU_CACHE["value"] = (cu, max(b - a for a, b in zip(bounds[:-1], bounds[1:])))
    return _CU_CACHE["value"]


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """A transformers attention function: variable-length attention when given the packed
    sequences' `cu_seq_lens_q`, SDPA (transformers' own) otherwise.

    query (1, Hq, T, D), key/value (1, Hkv, T, D) -> ((1, T, Hq, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    single_row = query.shape[0] == 1 and query.shape[2] == key.shape[2]
    if cu is None and single_row and attention_mask is None and kwargs.get("position_ids") is not None:
        cu, max_len = _cu_from_positions(kwargs["position_ids"])
    if cu is None or not single_row:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    out = None
    if q.is_cuda and _FLASH_OK.get("varlen", True):
        try:
            out = varlen_flash(q, k, v, cu, int(max_len), scale)
        except (RuntimeError, TypeError, AttributeError):
            _FLASH_OK["varlen"] = False
    if out is None:
        out = varlen_reference(q, k, v, cu.tolist(), scale)
    return out[None], None


def _varlen_mask(*args, attention_mask=None, q_length=None, kv_length=None, **kwargs):
    """No (T, T) mask for cache-free calls without a padding mask: the attention function
    separates packed sequences itself; padded and cached calls get SDPA's mask."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length and kwargs.get("q_offset", 0) == 0:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, **kwargs)


def register_varlen_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, _varlen_mask)


def use_varlen_attention(module: torch.nn.Module) -> None:
    """Switch a transformers model (any submodule tree with a `config`) to `rlhf_varlen`
    attention; calls without `cu_seq_lens_q` behave exactly as SDPA."""
    config = getattr(module, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) == VARLEN_ATTENTION:
        return
    register_varlen_attention()
    if hasattr(module, "set_attn_implementation"):
        module.set_attn_implementation(VARLEN_ATTENTION)
    else:
        for m in module.modules():
            if hasattr(m, "set_attn_implementation"):
                m.set_attn_implementation(VARLEN_ATTENTION)
                break
