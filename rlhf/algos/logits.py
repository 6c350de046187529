"""Per-token quantities from logits: entropy and the log-prob of a label, computed a
chunk of rows at a time so float32 temporaries stay bounded for bf16 logits over a large
vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.algos.masked import _float

Tensor = torch.Tensor


def _row_chunks(n_rows: int, chunk_size: Optional[int]) -> list[slice]:
    step = max(1, n_rows if chunk_size is None else chunk_size)
    return [slice(i, i + step) for i in range(0, n_rows, step)]


def entropy_from_logits(logits: Tensor, chunk_size: Optional[int] = None) -> Tensor:
    """Entropy of softmax(logits) per position: logsumexp(x) - sum(softmax(x) * x).

    logits: (..., V) -> (...) float32 (float64 kept). Stable for large logits; -inf
    logits (banned tokens) count as probability 0. `chunk_size` rows at a time bounds
    the float32 temporaries when logits are bf16 with a large vocabulary.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for rows in _row_chunks(flat.shape[0], chunk_size):
        x = _float(flat[rows])
        probs = torch.softmax(x, dim=-1)
        finite_x = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
        parts.append(torch.logsumexp(x, dim=-1) - (probs * finite_x).sum(-1))
    if not parts:
        return _float(logits.new_zeros(logits.shape[:-1]))
    return torch.cat(parts).reshape(logits.shape[:-1])


def logprobs_from_logits(logits: Tensor, labels: Tensor, chunk_size: Optional[int] = None) -> Tensor:
    """log softmax(logits)[label] per position, without materialising the log-softmax.

    logits: (..., V); labels: (...) int64 token ids -> (...) float32 (float64 kept).
    `chunk_size` rows at a time bounds the float32 temporaries.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1, 1)
    if flat.shape[0] != flat_labels.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree before the vocab dim")
    parts = []
    for rows in _row_chunks(flat.shape[0], chunk_size):
        x = _float(flat[rows])
        parts.append(x.gather(-1, flat_labels[rows]).squeeze(-1) - torch.logsumexp(x, dim=-1))
    if not parts:
        return _float(logits.new_zeros(labels.shape))
    return torch.cat(parts).reshape(labels.shape)
