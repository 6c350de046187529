"""Masked statistics over (B, T) tensors: means, variances and whitening over the positions
where a 0/1 mask is 1, and the critic's explained variance.

Values at masked positions never reach a result: they are zeroed before any arithmetic,
so NaN or huge padding values are harmless (gradients included).
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def _zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """`x` with masked positions set to 0 (NaN/inf there included)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _float(x: Tensor) -> Tensor:
    """At least float32 (keeps float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of `x` over positions where `mask` is 1; over all dims, or along `dim`.

    x, mask: same shape. A slice with no valid position has mean 0.
    """
    total = _zero_masked(x, mask).sum() if dim is None else _zero_masked(x, mask).sum(dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return total / count.clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, dim: Optional[int] = None, unbiased: bool = True) -> Tensor:
    """Variance of `x` over valid positions (Bessel-corrected when `unbiased`, as verl).

    With fewer than two valid positions the correction is skipped (result 0).
    """
    mean = masked_mean(x, mask, dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    var = masked_mean((x - mean) ** 2, mask, dim)
    if unbiased:
        count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
        var = torch.where(count > 1, var * count / (count - 1).clamp_min(1), var)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / std over all valid positions; masked positions become 0.

    x, mask: (B, T). With `shift_mean=False` the mean is added back (only the scale
    changes), as in verl.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_masked(whitened, mask)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(returns - values) / Var(returns) over valid positions (0-dim tensor).

    1 is a perfect critic, 0 no better than a constant, negative worse. The 1e-5 in the
    denominator follows verl's `critic/vf_explained_var`.
    """
    values, returns = _float(values), _float(returns)
    return 1.0 - masked_var(returns - values, mask) / (masked_var(returns, mask) + 1e-5)

