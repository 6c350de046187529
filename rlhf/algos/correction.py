"""Rollout correction: importance weights and rejection for responses sampled by a policy
other than the one the trainer's PPO ratio is anchored at.

The rollout engine's log-probs (vLLM's, `hf_fast`'s bf16 ones, or a stored table's
behaviour policy) differ from the trainer's recomputed ones; PPO that takes the trainer's
`old_log_prob` as the sampling distribution is then biased (Liu, Li et al. 2025, "When
Speed Kills Stability", https://richardli.xyz/rl-collapse; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training", truncated importance
sampling). Names, semantics and metrics are verl 0.9.1's `algorithm.rollout_correction`
(`verl/trainer/ppo/rollout_corr_helper.py`). With log r_t = log pi_old - log pi_rollout:

- IS weights (`rollout_is`): "token": r_t; "sequence": prod_t r_t broadcast over the
  response; each bounded to [e^-20, e^20] first. `rollout_is_threshold` is a number u
  (truncated IS: min(w, u)) or a string "lower_upper" (IcePop: w where lower <= w <= upper,
  else 0). `rollout_is_batch_normalize` divides them by their batch mean (over tokens, or
  over responses for "sequence"). They multiply the per-token policy loss.
- Rejection (`rollout_rs`, `rlhf.algos.rejection`): tokens or responses past a divergence
  threshold leave the response mask, which then serves the advantage estimator, the critic
  and the actor alike (verl applies it before `compute_advantage`).
- Bypass mode (`bypass_policy_loss`): the rollout log-probs are the PPO anchor, and the
  correction is computed inside the loss against the policy being trained.

Pure tensors in, `(value, metrics)` out; metrics are floats under `rollout_corr/`, as
verl logs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from rlhf.algos.losses import policy_loss, reinforce_loss
from rlhf.algos.masked import _zero_masked, masked_mean
from rlhf.algos.mismatch import offpolicy_metrics
from rlhf.algos.rejection import SAFETY_BOUND, rejection_mask
from rlhf.config.correction_spec import BYPASS_LOSS_TYPES, IS_LEVELS, Threshold, parse_is_threshold

Tensor = torch.Tensor
BatchMean = Callable[[Tensor, Tensor], Tensor]  # (x, mask) -> mean of x over mask, 0-dim


@dataclass
class Correction:
    """What the correction hands the estimator and the losses; (B, T) each."""

    weights: Optional[Tensor]  # IS weights, 0 at masked positions; None when `rollout_is` is off
    mask: Tensor  # response_mask with rejected tokens and responses set to 0


def is_weights(log_ratio: Tensor, response_mask: Tensor, level: str, threshold: Union[str, float] = 2.0,
               batch_normalize: bool = False, batch_mean: BatchMean = masked_mean
               ) -> tuple[Tensor, dict[str, float]]:
    """IS weights (B, T) of `level` from log r (B, T), 0 at masked positions, and verl's
    `rollout_is_*` metrics (taken before batch normalisation). `batch_mean(x, mask)` is the
    normalisation's mean (the trainer passes one over all ranks)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {', '.join(IS_LEVELS)} or null, got {level!r}")
    upper, lower = parse_is_threshold(threshold)
    valid = response_mask.bool()
    log_ratio = _zero_masked(log_ratio, valid)
    if level == "token":
        per = log_ratio  # (B, T)
    else:
        per = log_ratio.sum(-1, keepdim=True)  # (B, 1): log prod_t r_t
    raw = _zero_masked(torch.exp(per.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio), valid)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:  # IcePop: weights outside [lower, upper] are zeroed, the mask is left as it is
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, per, valid, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = float(masked_mean(((raw < lower) | (raw > upper)).float(), valid))
    if batch_normalize:
        if level == "token":
            mean = batch_mean(weights, valid)
        else:  # one weight per response that has tokens
            mean = batch_mean(masked_mean(weights, valid, dim=-1), valid.any(-1))
        if mean > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = float(mean) if mean > 1e-8 else 1.0
    return weights.detach(), metrics


def _is_metrics(weights: Tensor, raw: Tensor, per: Tensor, valid: Tensor, level: str, upper: float,
                lower: Optional[float]) -> dict[str, float]:
    """verl's `compute_is_metrics`. `per` is log r per token (token level) or per response
    (B, 1) (sequence level, every row counted, as verl counts it)."""
    lo = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {"rollout_is_mean": float(masked_mean(weights, valid))}  # token-weighted at both levels
    if level == "sequence":
        m["rollout_is_max"] = float(torch.exp(per.max().clamp(max=SAFETY_BOUND)))
        m["rollout_is_min"] = float(torch.exp(per.min()))
        m["rollout_is_ratio_fraction_high"] = float((per > math.log(upper)).float().mean())
        m["rollout_is_ratio_fraction_low"] = float((per < math.log(lo)).float().mean())
    else:
        m["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > upper).float(), valid))
        m["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < lo).float(), valid))
        m["rollout_is_max"], m["rollout_is_min"] = float(weights[valid].max()), float(weights[valid].min())
    w = weights.clamp(min=0.0, max=upper)
    mean_w = masked_mean(w, valid)
    var = masked_mean(w.square(), valid) - mean_w.square()
    m["rollout_is_std"] = float(var.clamp_min(0).sqrt()) if valid.sum() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = float(1.0 / masked_mean((w / (mean_w + 1e-8)).square(), valid))
    seq_w = masked_mean(weights, valid, dim=-1)  # (B,), every row
    m["rollout_is_seq_mean"] = float(seq_w.mean())
    m["rollout_is_seq_std"] = float(seq_w.std()) if seq_w.numel() > 1 else 0.0
    m["rollout_is_seq_max"], m["rollout_is_seq_min"] = float(seq_w.max()), float(seq_w.min())
    m["rollout_is_seq_max_deviation"] = float((seq_w - 1.0).abs().max())
    raw_seq = masked_mean(raw, valid, dim=-1)  # before truncation: a truncated mean never exceeds the cap
    m["rollout_is_seq_fraction_high"] = float((raw_seq > upper).float().mean())
    m["rollout_is_seq_fraction_low"] = float((raw_seq < lo).float().mean())
    return m


@torch.no_grad()
def compute_rollout_correction(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Optional[Union[str, float]] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[Threshold] = None,
    batch_mean: BatchMean = masked_mean,
) -> tuple[Correction, dict[str, float]]:
    """IS weights and rejection mask correcting samples of pi_rollout towards pi_old, as
    verl's `compute_rollout_correction_and_rejection_mask`.

    old_log_prob (the PPO anchor; in bypass mode the current policy), rollout_log_prob
    (the sampler's), response_mask: (B, T). `rollout_is` None (or a None threshold) gives
    no weights; `rollout_rs` None no rejection; the off-policy metrics are logged either
    way. Returns (Correction(weights, mask), metrics under `rollout_corr/`).
    """
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} differ")
    if not response_mask.bool().any():
        raise ValueError("response_mask must hold at least one valid token")
    log_ratio = old_log_prob - rollout_log_prob  # log r (B, T); masked positions are ignored below
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, m = is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold,
                                rollout_is_batch_normalize, batch_mean)
        metrics.update(m)
    mask = response_mask.clone()
    if rollout_rs is not None:
        mask, m = rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(m)
    metrics.update(offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return Correction(weights=weights, mask=mask), {f"rollout_corr/{k}": v for k, v in metrics.items()}


def bypass_policy_loss(
    logprob: Tensor,
    rollout_logprob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    loss_type: str = "ppo_clip",
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Optional[Union[str, float]] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[Union[str, float]] = None,
    batch_num_tokens: Optional[float] = None,
    global_batch_size: Optional[float] = None,
) -> tuple[Tensor, dict]:
    """verl's bypass mode (`compute_policy_loss_bypass_mode`): the PPO anchor is the rollout
    policy itself, and rollout correction is computed here against the *current* policy
    (IS weights pi_theta / pi_rollout, rejection by their divergence), so it moves as the
    policy does during the update.

    logprob (grad flows), rollout_logprob, advantages, response_mask: (B, T).
    `loss_type` "ppo_clip": `policy_loss` with ratio pi_theta / pi_rollout over the kept
    tokens, IS weights unused (the ratio is the correction; they are logged only);
    "reinforce": `reinforce_loss` with the IS weights. `batch_num_tokens` and
    `global_batch_size` replace the aggregation's denominators (verl's engine takes them
    before this loss rejects anything). Returns (loss, metrics): the loss's own metrics
    unprefixed, the correction's under `rollout_corr/`.
    """
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"rollout_correction.loss_type must be one of {', '.join(BYPASS_LOSS_TYPES)}, "
                         f"got {loss_type!r}")
    corr, corr_metrics = compute_rollout_correction(
        logprob.detach(), rollout_logprob, response_mask, rollout_is, rollout_is_threshold,
        rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold)
    denominators = dict(batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    if loss_type == "reinforce":
        loss, metrics = reinforce_loss(logprob, rollout_logprob, advantages, corr.mask, loss_agg_mode, corr.weights,
                                       **denominators)
    else:
        loss, metrics = policy_loss(logprob, rollout_logprob, advantages, corr.mask, clip_ratio_low,
                                    clip_ratio_high, clip_ratio_c, loss_agg_mode, **denominators)
    return loss, {**metrics, **corr_metrics}
