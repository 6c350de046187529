"""How far the rollout policy is from the trainer's: the diagnostics verl logs beside rollout
correction, computed as verl computes them, plus two of this project's own.

- `offpolicy_metrics`: verl's `compute_offpolicy_metrics` (`rollout_corr/` prefix added by
  the caller): KL(pi_rollout || pi_old) estimated on the rollout's samples, k1 (`kl`) and k3
  (`k3_kl`, Schulman 2020, http://joschu.net/blog/kl-approx.html); per-response perplexities
  of both policies and their log difference; chi^2 divergences per token and per response.
- `probs_diff_metrics`: verl's `calculate_debug_metrics` (`training/rollout_probs_diff_*`,
  `training/rollout_actor_probs_pearson_corr`) on |p_old - p_rollout| per token.
- `log_prob_diff_metrics`: this project's `rollout_corr/log_prob_abs_diff_mean|max`
  (|log pi_old - log pi_rollout| per token), which verl does not log.

Tensors are (B, T) with a 0/1 `response_mask`; values at masked positions never reach a
result. Per-response statistics average over every row, rows without a valid token
included (as verl does).
"""

from __future__ import annotations

import torch

from rlhf.algos.masked import _zero_masked, masked_mean

Tensor = torch.Tensor
SAFETY_BOUND = 20.0


@torch.no_grad()
def offpolicy_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """verl's off-policy diagnostics, unprefixed: training_ppl, training_log_ppl, kl, k3_kl,
    rollout_ppl, rollout_log_ppl, log_ppl_diff (mean, abs mean, max, min), ppl_ratio,
    chi2_token, chi2_seq."""
    valid = response_mask.bool()
    old, roll = _zero_masked(old_log_prob, valid), _zero_masked(rollout_log_prob, valid)
    log_r = old - roll  # log pi_old / pi_rollout, 0 at masked positions
    mean_old = masked_mean(old, valid, dim=-1)  # (B,)
    mean_roll = masked_mean(roll, valid, dim=-1)
    log_ppl_diff = mean_roll - mean_old  # (B,)
    safe = log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_log_r = log_r.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B,)
    return {
        "training_ppl": float(torch.exp(-mean_old).mean()),
        "training_log_ppl": float((-mean_old).mean()),
        "kl": float(masked_mean(roll - old, valid)),
        "k3_kl": float(masked_mean(torch.exp(log_r) - log_r - 1, valid)),
        "rollout_ppl": float(torch.exp(-mean_roll).mean()),
        "rollout_log_ppl": float((-mean_roll).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "log_ppl_diff_max": float(log_ppl_diff.max()),
        "log_ppl_diff_min": float(log_ppl_diff.min()),
        "ppl_ratio": float(torch.exp(log_ppl_diff).mean()),
        "chi2_token": float(masked_mean(torch.exp(safe).square(), valid) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log_r).mean() - 1.0),
    }


@torch.no_grad()
def probs_diff_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """verl's `calculate_debug_metrics`: |p_old - p_rollout| over valid tokens (max, mean,
    std) and the Pearson correlation of the two probabilities (arXiv:2506.13585)."""
    valid = response_mask.bool()
    if not valid.any():
        nan = float("nan")
        return {"training/rollout_probs_diff_valid": 0.0, "training/rollout_probs_diff_max": nan,
                "training/rollout_probs_diff_mean": nan, "training/rollout_probs_diff_std": nan,
                "training/rollout_actor_probs_pearson_corr": nan}
    p_old, p_roll = torch.exp(old_log_prob[valid]), torch.exp(rollout_log_prob[valid])
    diff = (p_old - p_roll).abs()
    corr = torch.corrcoef(torch.stack([p_old, p_roll]))[0, 1]
    return {"training/rollout_probs_diff_valid": 1.0, "training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_mean": float(diff.mean()),
            "training/rollout_probs_diff_std": float(diff.std()),
            "training/rollout_actor_probs_pearson_corr": float(corr)}


@torch.no_grad()
def log_prob_diff_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """This project's |log pi_old - log pi_rollout| per valid token, mean and max."""
    valid = response_mask.bool()
    if not valid.any():
        return {}
    diff = (old_log_prob - rollout_log_prob)[valid].abs()
    return {"rollout_corr/log_prob_abs_diff_mean": float(diff.mean()),
            "rollout_corr/log_prob_abs_diff_max": float(diff.max())}
