"""Rollout rejection (verl's `rollout_rs`): drop tokens or whole responses whose divergence
between the trainer's policy and the rollout's is past a threshold.

Names, thresholds and metrics are verl 0.9.1's (`compute_rollout_rejection_mask` and
`compute_rs_metrics` in `verl/trainer/ppo/rollout_corr_helper.py`). With
log r_t = log pi_old - log pi_rollout per token (bounded to [-20, 20] first), the per-token
divergences are

    k1 = -log r,    k2 = (log r)^2 / 2,    k3 = r - 1 - log r   (Schulman 2020,
    http://joschu.net/blog/kl-approx.html),

and a criterion is `<level>_<k>`: `token_k*` judges each token; `seq_sum_k*`, `seq_mean_k*`
and `seq_max_k*` (k2, k3 only) judge a response by the sum, mean or max of its tokens' values
and keep or drop it whole. k2 and k3 have an upper bound only; k1 keeps
log(lower) <= k1 <= log(upper), so `"lower_upper"` bounds pi_rollout / pi_old (a single
number u means lower = 1/u). Several criteria joined by commas must all pass; thresholds
are one string for all of them or one per criterion, comma-separated ("0.5_2,0.01");
`rlhf.config.correction_spec` parses both.

Pure tensors in, `(keep mask, metrics)` out; metric names are verl's without the
`rollout_corr/` prefix the caller adds.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from rlhf.algos.masked import _zero_masked
from rlhf.config.correction_spec import Threshold, parse_criteria, parse_rs_thresholds

Tensor = torch.Tensor

SAFETY_BOUND = 20.0  # log-space bound on every ratio before exp, as verl


def _divergence(log_r: Tensor, k: str) -> Tensor:
    if k == "k1":
        return -log_r
    if k == "k2":
        return 0.5 * log_r.square()
    return torch.exp(log_r) - 1.0 - log_r


def _per_sequence(stat: Tensor, valid: Tensor, level: str) -> Tensor:
    """(B,) sum, mean or max of a per-token statistic over each response's valid tokens
    (0 for a response without any)."""
    if level == "seq_sum":
        return _zero_masked(stat, valid).sum(-1)
    if level == "seq_mean":
        return _zero_masked(stat, valid).sum(-1) / valid.sum(-1).clamp_min(1)
    top = stat.masked_fill(~valid, float("-inf")).amax(-1)
    return torch.where(torch.isinf(top) & (top < 0), torch.zeros_like(top), top)


def _mmean(x: Tensor, valid: Tensor) -> float:
    return float(_zero_masked(x, valid).sum() / valid.sum().clamp_min(1))


@torch.no_grad()
def rejection_mask(log_ratio: Tensor, response_mask: Tensor, rollout_rs: str, rollout_rs_threshold: Threshold
                   ) -> tuple[Tensor, dict[str, float]]:
    """response_mask (B, T) with the tokens and responses that fail any criterion set to 0.

    log_ratio: (B, T) log pi_old - log pi_rollout. Returns (mask, metrics): per criterion
    `rollout_rs_<criterion>_*` (mean, max, min, std, fractions past the bounds, sequence
    summaries, masked fractions), then `rollout_rs_masked_fraction` (of tokens) and
    `rollout_rs_seq_masked_fraction` (of responses with a dropped token, over all rows).
    """
    valid = response_mask.bool()
    if valid.shape[0] == 0:
        return response_mask, {}
    if not valid.any():
        raise ValueError("response_mask must hold at least one valid token")
    criteria = parse_criteria(rollout_rs)
    bounds = parse_rs_thresholds(criteria, rollout_rs_threshold)
    log_r = _zero_masked(log_ratio, valid).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    keep_all = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    for name in criteria:
        level, k = name.rsplit("_", 1)
        lower, upper = bounds[name]
        lo, hi = (math.log(lower), math.log(upper)) if k == "k1" else (None, upper)
        token_stat = _divergence(log_r, k)
        seq_stat = None if level == "token" else _per_sequence(token_stat, valid, level)
        stat = token_stat if seq_stat is None else seq_stat.unsqueeze(-1).expand_as(token_stat)
        keep = (stat <= hi) & (stat >= lo if lo is not None else True)
        keep_all &= keep
        metrics.update(_criterion_metrics(name, stat, seq_stat, valid, keep, lo, hi))
    metrics["rollout_rs_masked_fraction"] = _mmean((~keep_all).float(), valid)
    metrics["rollout_rs_seq_masked_fraction"] = float((valid & ~keep_all).any(-1).float().mean())
    return response_mask * keep_all.to(response_mask.dtype), metrics


def _criterion_metrics(name: str, stat: Tensor, seq_stat: Optional[Tensor], valid: Tensor, keep: Tensor,
                       lo: Optional[float], hi: float) -> dict[str, float]:
    """verl's `compute_rs_metrics` for one criterion, plus its masked fractions. `stat` is
    (B, T) (a response's value broadcast over its tokens for sequence criteria); `lo`/`hi`
    are in the statistic's units (log bounds for k1)."""
    p = f"rollout_rs_{name}"
    rows = valid.any(-1)  # (B,)
    per_seq = seq_stat if seq_stat is not None else _zero_masked(stat, valid).sum(-1) / valid.sum(-1).clamp_min(1)
    seqs = per_seq[rows]
    lo_m = lo if lo is not None else 0.0
    m = {f"{p}_mean": _mmean(stat, valid)}
    if seq_stat is not None:
        m[f"{p}_max"], m[f"{p}_min"] = float(seqs.max()), float(seqs.min())
        m[f"{p}_fraction_high"] = float((seqs > hi).float().mean())
        m[f"{p}_fraction_low"] = float((seqs < lo_m).float().mean()) if lo is not None else 0.0
    else:
        m[f"{p}_max"], m[f"{p}_min"] = float(stat[valid].max()), float(stat[valid].min())
        m[f"{p}_fraction_high"] = _mmean((stat > hi).float(), valid)
        m[f"{p}_fraction_low"] = _mmean((stat < lo_m).float(), valid) if lo is not None else 0.0
    clamped = stat.clamp(min=lo_m, max=hi)
    var = _mmean(clamped.square(), valid) - _mmean(clamped, valid) ** 2
    m[f"{p}_std"] = math.sqrt(max(var, 0.0)) if valid.sum() > 1 else 0.0
    m[f"{p}_seq_mean"] = float(seqs.mean())
    m[f"{p}_seq_std"] = float(seqs.std()) if seqs.numel() > 1 else 0.0
    m[f"{p}_seq_max"], m[f"{p}_seq_min"] = float(seqs.max()), float(seqs.min())
    m[f"{p}_seq_max_deviation"] = float(seqs.abs().max())
    m[f"{p}_seq_fraction_high"] = float((seqs > hi).float().mean())
    if lo is not None:
        m[f"{p}_seq_fraction_low"] = float((seqs < lo).float().mean())
    m[f"{p}_masked_fraction"] = _mmean((~keep).float(), valid)
    seq_dropped = (valid & ~keep).any(-1)
    m[f"{p}_seq_masked_fraction"] = float(seq_dropped[rows].float().mean())
    return m
