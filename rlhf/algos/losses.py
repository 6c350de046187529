"""PPO losses: `agg_loss` (verl's `loss_agg_mode`s), the clipped policy surrogate
`policy_loss`, the clipped value loss `value_loss`, and `reinforce_loss` (verl's REINFORCE
with IS weights, the policy loss of rollout correction's bypass mode with loss_type
"reinforce"; `rlhf.algos.correction.bypass_policy_loss` chooses between the two).

Loss metrics are detached 0-dim tensors (no device sync per micro-batch); call `float()`
when logging.
"""

from __future__ import annotations

from typing import Optional

import torch

from rlhf.algos.masked import _zero_masked, masked_mean

Tensor = torch.Tensor

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    *,
    batch_num_tokens: Optional[float] = None,
    global_batch_size: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar, as verl's `agg_loss`.

    - token-mean: sum over valid tokens / number of valid tokens (`batch_num_tokens`
      overrides the count, e.g. the mini-batch's count when accumulating micro-batches).
    - seq-mean-token-sum: each sequence's token sum, averaged over sequences with at
      least one valid token (`global_batch_size` overrides that count).
    - seq-mean-token-mean: each sequence's token mean, averaged the same way.
    - token-sum: the sum over all valid tokens.
    - seq-mean-token-sum-norm (Dr. GRPO, arXiv:2503.20783): seq-mean-token-sum divided by a
      constant, `loss_scale_factor` or else the mask's width T (verl 0.9.1's definition).
    """
    valid = loss_mask.bool()
    seq_sum = _zero_masked(loss_mat, valid).sum(-1)  # (B,)
    seq_len = valid.sum(-1)  # (B,)
    if loss_agg_mode == "token-mean":
        n_tokens = seq_len.sum().clamp_min(1) if batch_num_tokens is None else batch_num_tokens
        return seq_sum.sum() / n_tokens
    if loss_agg_mode == "token-sum":
        return seq_sum.sum()
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        per_seq = seq_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_len.clamp_min(1)
    else:
        raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; known: {', '.join(LOSS_AGG_MODES)}")
    n_seqs = (seq_len > 0).sum().clamp_min(1) if global_batch_size is None else global_batch_size
    loss = per_seq.sum() / n_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    batch_num_tokens: Optional[float] = None,
    global_batch_size: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
    rollout_is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, dict]:
    """Clipped PPO surrogate (Schulman et al. 2017, arXiv:1707.06347) with dual clip for
    negative advantages (Ye et al. 2019, arXiv:1912.09729).

    logprob (grad flows), old_logprob, advantages, response_mask: (B, T). With
    ratio = exp(clamp(logprob - old_logprob, -20, 20)):
      L = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
      and for A < 0: L = min(L, -A * clip_ratio_c)
    Returns (loss, metrics) with detached 0-dim tensors (verl definitions):
      pg_clipfrac: fraction of valid tokens where the clipped term is the larger one;
      pg_clipfrac_lower: fraction where the dual clip (A < 0, ratio > clip_ratio_c) binds;
      ppo_kl: mean of old_logprob - logprob (k1 estimate of KL(old || new)).
    `rollout_is_weights` (B, T), detached, multiply the per-token loss before aggregation
    (rollout correction, `rlhf.algos.correction`), as verl does.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c is the dual-clip bound and must be > 1, got {clip_ratio_c}")
    valid = response_mask.bool()
    log_ratio = _zero_masked(logprob - old_logprob, valid).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    adv = _zero_masked(advantages, valid)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * _zero_masked(rollout_is_weights.detach(), valid)
    loss = agg_loss(
        pg_losses,
        valid,
        loss_agg_mode,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((pg_losses2 > pg_losses1).float(), valid),
            "pg_clipfrac_lower": masked_mean(((clip_pg_losses1 > pg_losses3) & (adv < 0)).float(), valid),
            "ppo_kl": masked_mean(-log_ratio, valid),
        }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    batch_num_tokens: Optional[float] = None,
    global_batch_size: Optional[float] = None,
    loss_scale_factor: Optional[float] = None,
) -> tuple[Tensor, dict]:
    """Clipped value loss: 0.5 * agg(max((V - R)^2, (V_clip - R)^2)) with
    V_clip = V_old + clip(V - V_old, -cliprange_value, cliprange_value).

    values (grad flows), old_values, returns, response_mask: (B, T). Returns (loss,
    metrics) with detached 0-dim tensors `vf_clipfrac` (fraction of valid tokens where
    the clipped term is the larger one) and `vpred_mean`.
    """
    valid = response_mask.bool()
    values = _zero_masked(values, valid)
    old_values = _zero_masked(old_values, valid)
    returns = _zero_masked(returns, valid)
    values_clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    vf_losses1 = (values - returns) ** 2
    vf_losses2 = (values_clipped - returns) ** 2
    loss = 0.5 * agg_loss(
        torch.maximum(vf_losses1, vf_losses2),
        valid,
        loss_agg_mode,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean((vf_losses2 > vf_losses1).float(), valid),
            "vpred_mean": masked_mean(values, valid),
        }
    return loss, metrics


def reinforce_loss(logprob: Tensor, rollout_logprob: Tensor, advantages: Tensor, response_mask: Tensor,
                   loss_agg_mode: str = "token-mean", rollout_is_weights: Optional[Tensor] = None, *,
                   batch_num_tokens: Optional[float] = None, global_batch_size: Optional[float] = None
                   ) -> tuple[Tensor, dict]:
    """REINFORCE with optional IS weights (verl's `compute_policy_loss_reinforce`), no clipping:
    L = agg(-A * w * log pi), w detached. All (B, T). Metric `ppo_kl`: mean of
    rollout_logprob - logprob over valid tokens."""
    valid = response_mask.bool()
    pg_losses = -_zero_masked(advantages, valid) * _zero_masked(logprob, valid)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * _zero_masked(rollout_is_weights.detach(), valid)
    loss = agg_loss(pg_losses, valid, loss_agg_mode, batch_num_tokens=batch_num_tokens,
                    global_batch_size=global_batch_size)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(rollout_logprob - logprob, valid)}
    return loss, metrics
