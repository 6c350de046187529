"""Rollout correction: importance weights and rejection for responses sampled by a policy
other than the one the trainer's PPO ratio is anchored at.

The rollout engine's log-probs (vLLM's, `hf_fast`'s bf16 ones, or a stored table's
behaviour policy) differ from the trainer's recomputed ones; PPO that takes the trainer's
`old_log_prob` as the sampling distribution is then biased (Liu, Li et al. 2025, "When
Speed Kills Stability", https://richardli.xyz/rl-collapse; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training", truncated importance
sampling). Names and semantics follow verl's `algorithm.rollout_correction`
(`verl/trainer/ppo/rollout_corr_helper.py`), decoupled mode: with
log rho_t = old_log_prob_t - rollout_log_prob_t (pi_old / pi_rollout per token),

- IS weights (`rollout_is`): "token": rho_t; "sequence": prod_t rho_t broadcast over the
  response. Bounded to [e^-20, e^20] first, then truncated (TIS) at
  `rollout_is_threshold` (an upper cap only); optionally divided by their batch mean
  (`rollout_is_batch_normalize`). They multiply the per-token policy loss.
- Rejection (`rollout_rs`): "token" drops tokens whose rho_t is outside
  [lower, upper]; "sequence" drops responses whose prod rho_t is; "geometric" drops
  responses whose geometric mean exp(mean_t log rho_t) is. `lower` defaults to 1/upper,
  `upper` to `rollout_is_threshold`. `rollout_token_veto_threshold` drops a response in
  which any token has rho_t below it. Dropped tokens leave the loss and its denominator.

Pure tensors in, `(value, metrics)` out; metrics are floats named as verl logs them under
`rollout_corr/`, plus the mismatch between the two log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from rlhf.algos.masked import _zero_masked, masked_mean

Tensor = torch.Tensor

SAFETY_BOUND = 20.0  # log-space bound on every ratio before exp, as verl
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclass
class Correction:
    """What the correction hands the policy loss; (B, T) each."""

    weights: Tensor  # IS weights, 0 at masked positions (1 where IS is off)
    mask: Tensor  # response_mask with rejected tokens and responses set to 0


def _seq_sum(x: Tensor, valid: Tensor) -> Tensor:
    return _zero_masked(x, valid).sum(-1, keepdim=True)  # (B, 1)


def is_weights(log_ratio: Tensor, valid: Tensor, level: str, threshold: float, batch_normalize: bool = False
               ) -> tuple[Tensor, dict[str, float]]:
    """Truncated IS weights (B, T) of `level` from log rho (B, T); 0 at masked positions."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {', '.join(IS_LEVELS)} or off, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    per = log_ratio if level == "token" else _seq_sum(log_ratio, valid).expand_as(log_ratio)
    raw = torch.exp(per.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    weights = raw.clamp(max=threshold)
    unit = valid if level == "token" else valid.any(-1, keepdim=True).expand_as(valid)  # one weight per unit
    if level == "sequence":
        unit = unit & (torch.arange(valid.shape[1], device=valid.device) == 0)  # count each response once
    if batch_normalize:
        weights = weights / masked_mean(weights, unit).clamp_min(1e-8)
    metrics = _is_metrics(weights, raw, per, unit, threshold)  # before zeroing: a response's weight sits at t=0
    return _zero_masked(weights, valid), metrics


def _is_metrics(weights: Tensor, raw: Tensor, log_w: Tensor, unit: Tensor, threshold: float) -> dict[str, float]:
    """verl's names: mean of the applied weights, min/max of the ratios before truncation,
    the fraction truncated (`rollout_is_ratio_fraction_high`), the effective sample size."""
    if not unit.any():
        return {}
    w = weights[unit]
    norm = w / w.mean().clamp_min(1e-8)
    return {
        "rollout_corr/rollout_is_mean": float(w.mean()),
        "rollout_corr/rollout_is_weights_max": float(w.max()),
        "rollout_corr/rollout_is_max": float(raw[unit].max()),
        "rollout_corr/rollout_is_min": float(raw[unit].min()),
        "rollout_corr/rollout_is_eff_sample_size": float(1.0 / norm.square().mean().clamp_min(1e-8)),
        "rollout_corr/rollout_is_ratio_fraction_high": float((log_w[unit] > math.log(threshold)).float().mean()),
    }


def rejection_mask(log_ratio: Tensor, valid: Tensor, level: Optional[str], upper: float,
                   lower: Optional[float] = None, veto: Optional[float] = None) -> tuple[Tensor, dict[str, float]]:
    """(B, T) 0/1 keep-mask: `level` rejection outside [lower, upper] and the per-token veto."""
    keep = valid.clone()
    metrics: dict[str, float] = {}
    if level is not None:
        if level not in RS_LEVELS:
            raise ValueError(f"rollout_rs must be one of {', '.join(RS_LEVELS)} or off, got {level!r}")
        lo = 1.0 / upper if lower is None else lower
        if not 0 < lo <= upper:
            raise ValueError(f"rollout_rs thresholds need 0 < lower <= upper, got lower={lo}, upper={upper}")
        if level == "token":
            stat = log_ratio
        elif level == "sequence":
            stat = _seq_sum(log_ratio, valid).expand_as(log_ratio)
        else:
            stat = (_seq_sum(log_ratio, valid) / valid.sum(-1, keepdim=True).clamp_min(1)).expand_as(log_ratio)
        inside = (stat >= math.log(lo)) & (stat <= math.log(upper))
        if level != "token":  # a response is kept or dropped whole
            inside = inside | ~valid
            inside = inside.all(-1, keepdim=True).expand_as(valid)
        keep = keep & inside
        metrics["rollout_corr/rollout_rs_masked_fraction"] = float(masked_mean((~inside).float(), valid))
    if veto is not None:
        bad = ((log_ratio < math.log(veto)) & valid).any(-1, keepdim=True)  # (B, 1)
        keep = keep & ~bad
        metrics["rollout_corr/rollout_is_veto_fraction"] = float(bad.float().mean())
    rows = valid.any(-1)
    dropped = (valid & ~keep).any(-1)
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float(dropped[rows].float().mean()) if rows.any() else 0.0
    return keep, metrics


def mismatch_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """How far the rollout policy is from the trainer's: |log-prob difference| mean and max,
    verl's `training/rollout_probs_diff_mean|max` (|p_rollout - p_old| per token), and
    KL(pi_rollout || pi_old) estimated on the rollout's own samples, k1 and k3
    (Schulman 2020, http://joschu.net/blog/kl-approx.html)."""
    valid = response_mask.bool()
    if not valid.any():
        return {}
    diff = _zero_masked(rollout_log_prob - old_log_prob, valid)  # log(pi_rollout / pi_old)
    probs = (torch.exp(rollout_log_prob.clamp(max=0)) - torch.exp(old_log_prob.clamp(max=0))).abs()
    log_r = (-diff).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # log(pi_old / pi_rollout)
    return {
        "rollout_corr/log_prob_abs_diff_mean": float(masked_mean(diff.abs(), valid)),
        "rollout_corr/log_prob_abs_diff_max": float(diff.abs()[valid].max()),
        "rollout_corr/kl": float(masked_mean(diff, valid)),
        "rollout_corr/k3_kl": float(masked_mean(torch.exp(log_r) - 1 - log_r, valid)),
        "training/rollout_probs_diff_mean": float(masked_mean(probs, valid)),
        "training/rollout_probs_diff_max": float(probs[valid].max()),
    }


@torch.no_grad()
def compute_rollout_correction(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    rollout_is: Optional[str] = "token",
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[float] = None,
    rollout_rs_threshold_lower: Optional[float] = None,
    rollout_token_veto_threshold: Optional[float] = None,
) -> tuple[Correction, dict[str, float]]:
    """IS weights and rejection mask correcting samples of pi_rollout towards pi_old.

    old_log_prob (the trainer's, the PPO anchor), rollout_log_prob (the sampler's),
    response_mask: (B, T). `rollout_is` / `rollout_rs` None switch that part off (the
    mismatch metrics are logged either way). Returns (Correction(weights, mask), metrics).
    """
    valid = response_mask.bool()
    log_ratio = _zero_masked(old_log_prob - rollout_log_prob, valid)  # log rho (B, T)
    metrics = mismatch_metrics(old_log_prob, rollout_log_prob, response_mask)
    weights = valid.to(old_log_prob.dtype)
    if rollout_is is not None:
        weights, m = is_weights(log_ratio, valid, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(m)
    upper = rollout_rs_threshold if rollout_rs_threshold is not None else rollout_is_threshold
    keep, m = rejection_mask(log_ratio, valid, rollout_rs, upper, rollout_rs_threshold_lower,
                             rollout_token_veto_threshold)
    metrics.update(m)
    return Correction(weights=weights, mask=keep.to(response_mask.dtype)), metrics
