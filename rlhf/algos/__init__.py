"""PPO math as pure tensor functions: KL estimators and controllers, advantages, losses.

Names and semantics follow verl's `verl/trainer/ppo/core_algos.py`, so the two can be
compared line by line. Tensors are `(B, T)` = (batch, response_len) unless stated, and
`response_mask` is 0/1 over response tokens (1 = the policy produced this token).

More of the same kind lives beside it: `rlhf.algos.outcome` (RLOO, REINFORCE++-baseline,
registered in ADV_ESTIMATORS) and `rlhf.algos.correction` (rollout correction: importance
weights and rejection for off-policy samples).

Where this file departs from verl:
- Values at masked positions never reach a result: inputs are zeroed there before any
  arithmetic (so NaN or huge padding values are harmless, gradients included), and
  per-token outputs are 0 at masked positions (verl leaves whatever was computed).
- `masked_var` with a single valid element returns 0 instead of raising.
- Loss metrics are detached 0-dim tensors (no device sync per micro-batch); call
  `float()` when logging.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from rlhf.config.registry import Registry

Tensor = torch.Tensor
GroupIds = Union[Tensor, np.ndarray, Sequence[Any]]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ---------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------
# KL estimators: J. Schulman, "Approximating KL Divergence" (2020),
# http://joschu.net/blog/kl-approx.html. With r = p_ref(x) / p(x) and x ~ p:
#   k1 = -log r            unbiased, high variance, can be negative
#   k2 = 0.5 (log r)^2     biased, low variance, >= 0
#   k3 = (r - 1) - log r   unbiased, low variance, >= 0
# ---------------------------------------------------------------------------------

KL_ESTIMATORS: Registry = Registry("kl estimator")


@KL_ESTIMATORS.register("kl", "k1")
def kl_k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def kl_abs(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return (logprob - ref_logprob).abs()


@KL_ESTIMATORS.register("mse", "k2")
def kl_k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def kl_k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    # Clamps as verl: log r to [-20, 20] so exp stays finite, the estimate to [-10, 10].
    log_r = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (torch.exp(log_r) - log_r - 1).clamp(-10.0, 10.0)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate of `kind` (see KL_ESTIMATORS.names()).

    logprob, ref_logprob: (B, T) log-probs of the sampled tokens -> (B, T).
    """
    return KL_ESTIMATORS.get(kind)(logprob, ref_logprob)


# ---------------------------------------------------------------------------------
# KL coefficient controllers
# ---------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient `value`."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences" (arXiv:1909.08593), section 2.2: a proportional controller that
    steers the observed KL towards `target_kl`, by at most 20% of n_steps/horizon per update.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


KL_CONTROLLERS: Registry = Registry("kl controller")
KL_CONTROLLERS.add("fixed", lambda kl_coef, target_kl, horizon: FixedKLController(kl_coef))
KL_CONTROLLERS.add("adaptive", lambda kl_coef, target_kl, horizon: AdaptiveKLController(kl_coef, target_kl, horizon))


def make_kl_controller(type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    """`FixedKLController` or `AdaptiveKLController` by name (`algorithm.kl_ctrl.type`)."""
    return KL_CONTROLLERS.get(type)(kl_coef, target_kl, horizon)


# ---------------------------------------------------------------------------------
# Rewards and advantages
# ---------------------------------------------------------------------------------


def compute_token_level_rewards(
    scores: Tensor, response_mask: Tensor, kl: Optional[Tensor] = None, kl_coef: float = 0.0
) -> tuple[Tensor, dict]:
    """Outcome score on the last valid response token, minus `kl_coef * kl` per token.

    scores: (B,) one score per response. response_mask: (B, T). kl: (B, T) per-token KL
    estimate (`kl_penalty`) or None. Returns token_level_rewards (B, T), 0 at masked
    positions, and, when `kl` is given, float metrics `reward_kl_penalty` (mean over
    responses of each response's token-mean KL, as verl) and `reward_kl_penalty_coeff`.
    A response with no valid token gets no reward.
    """
    valid = response_mask.bool()
    _, T = valid.shape
    positions = torch.arange(T, device=valid.device).expand_as(valid)  # (B, T)
    last = torch.where(valid, positions, -1).amax(-1, keepdim=True)  # (B, 1), -1 if empty
    scores = _float(torch.as_tensor(scores, device=valid.device)).reshape(-1, 1)  # (B, 1)
    if scores.shape[0] != valid.shape[0]:
        raise ValueError(f"scores has {scores.shape[0]} entries but response_mask has {valid.shape[0]} rows")
    rewards = torch.where(positions == last, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
    if kl is None:
        return rewards, {}
    kl = _zero_masked(kl, valid)
    rewards = rewards - kl_coef * kl
    current_kl = masked_mean(kl, valid, dim=-1).mean()
    return rewards, {"reward_kl_penalty": float(current_kl), "reward_kl_penalty_coeff": float(kl_coef)}


@torch.no_grad()
def compute_gae(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2015, arXiv:1506.02438), unwhitened.

    token_level_rewards, values, response_mask: (B, T). Returns (advantages, returns),
    each (B, T) and 0 at masked positions; returns = advantages + values.
      delta_t = r_t + gamma * V_{t'} - V_t,   A_t = delta_t + gamma * lam * A_{t'}
    where t' is the next *valid* position (V, A = 0 past the last one). Masked positions,
    at the end or in the middle (e.g. tool output between turns), are skipped as in verl:
    their rewards and values are ignored and the recursion carries across them.
    """
    valid = response_mask.bool()
    dtype = torch.promote_types(torch.promote_types(token_level_rewards.dtype, values.dtype), torch.float32)
    rewards = _zero_masked(token_level_rewards, valid).to(dtype)
    values = _zero_masked(values, valid).to(dtype)
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    last_gae = torch.zeros_like(values[:, 0])  # (B,)
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(valid[:, t], delta + gamma * lam * last_gae, last_gae)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = last_gae
    advantages = _zero_masked(advantages, valid)
    return advantages, _zero_masked(advantages + values, valid)


def compute_gae_advantage_return(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """verl's GAE entry point: `compute_gae` with the advantages whitened over the batch.

    Returns (advantages (B, T) whitened, returns (B, T) unwhitened).
    """
    advantages, returns = compute_gae(token_level_rewards, values, response_mask, gamma, lam)
    return masked_whiten(advantages, response_mask), returns


def _group_index(group_ids: GroupIds, n: int, device: torch.device) -> Tensor:
    """(n,) int64 index of each row's group, from any hashable ids (ints, uid strings)."""
    if isinstance(group_ids, Tensor):
        _, inverse = torch.unique(group_ids.to(device).reshape(-1), return_inverse=True)
    else:
        _, inverse_np = np.unique(np.asarray(group_ids), return_inverse=True)
        inverse = torch.as_tensor(inverse_np.reshape(-1), device=device)
    if inverse.numel() != n:
        raise ValueError(f"group_ids has {inverse.numel()} entries but there are {n} responses")
    return inverse


@torch.no_grad()
def compute_grpo_advantages(
    scores: Tensor,
    group_ids: GroupIds,
    response_mask: Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantages (Shao et al. 2024, arXiv:2402.03300): each score minus its
    group's mean, divided by the group's (unbiased) std + epsilon when `norm_by_std`
    (False gives Dr. GRPO, arXiv:2503.20783), broadcast over the response tokens.

    scores: (B,). group_ids: (B,) one id per response (responses to the same prompt share
    it). response_mask: (B, T). Returns (advantages, returns), both (B, T), equal, 0 at
    masked positions. As in verl, a group of one has mean 0 and std 1.
    """
    valid = response_mask.bool()
    scores = _float(torch.as_tensor(scores, device=valid.device)).reshape(-1)  # (B,)
    if scores.shape[0] != valid.shape[0]:
        raise ValueError(f"scores has {scores.shape[0]} entries but response_mask has {valid.shape[0]} rows")
    group = _group_index(group_ids, scores.shape[0], scores.device)  # (B,)
    count = torch.bincount(group).to(scores.dtype)  # (G,)
    mean = torch.zeros_like(count).index_add_(0, group, scores) / count
    sq_dev = torch.zeros_like(count).index_add_(0, group, (scores - mean[group]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp_min(1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    normed = scores - mean[group]
    if norm_by_std:
        normed = normed / (std[group] + epsilon)
    advantages = _zero_masked(normed.unsqueeze(-1).expand(valid.shape), valid)
    return advantages, advantages.clone()


ADV_ESTIMATORS: Registry = Registry("advantage estimator")


@ADV_ESTIMATORS.register("gae")
def gae_estimator(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Optional[Tensor] = None,
    group_ids: Optional[GroupIds] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: Callable[[Tensor, Tensor], Tensor] = masked_whiten,
) -> tuple[Tensor, Tensor]:
    """GAE with advantages whitened by `whiten` (over all ranks in the trainer); needs critic `values`."""
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values; pass values=... or use 'grpo'")
    advantages, returns = compute_gae(token_level_rewards, values, response_mask, gamma, lam)
    return _zero_masked(whiten(advantages, response_mask), response_mask), returns


@ADV_ESTIMATORS.register("grpo")
def grpo_estimator(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Optional[Tensor] = None,
    group_ids: Optional[GroupIds] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: Callable[[Tensor, Tensor], Tensor] = masked_whiten,
) -> tuple[Tensor, Tensor]:
    """GRPO on each response's total reward (score plus any in-reward KL), as verl."""
    if group_ids is None:
        raise ValueError("advantage estimator 'grpo' needs group_ids (one id per prompt's group of responses)")
    scores = _zero_masked(token_level_rewards, response_mask).sum(-1)  # (B,)
    return compute_grpo_advantages(scores, group_ids, response_mask, norm_by_std)


def compute_advantages(
    adv_estimator: str,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Optional[Tensor] = None,
    group_ids: Optional[GroupIds] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten: Callable[[Tensor, Tensor], Tensor] = masked_whiten,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns), each (B, T), from the estimator named `adv_estimator`.

    Every estimator reads `token_level_rewards` (score minus any in-reward KL), so the KL
    penalty reaches the advantages whichever estimator is chosen. `whiten(x, mask)` is the
    batch whitening of the estimators that whiten (gae, reinforce_plus_plus_baseline); the
    trainer passes one that reduces over all ranks.
    """
    return ADV_ESTIMATORS.get(adv_estimator)(
        token_level_rewards,
        response_mask,
        values=values,
        group_ids=group_ids,
        gamma=gamma,
        lam=lam,
        norm_by_std=norm_by_std,
        whiten=whiten,
    )


# ---------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------


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
    - seq-mean-token-sum-norm (Dr. GRPO, arXiv:2503.20783): the sum of all sequences'
      token sums divided by a constant, `loss_scale_factor` or else the mask's width T.
      As in verl this is a sum over sequences, not a mean.
    """
    valid = loss_mask.bool()
    seq_sum = _zero_masked(loss_mat, valid).sum(-1)  # (B,)
    seq_len = valid.sum(-1)  # (B,)
    if loss_agg_mode == "token-mean":
        n_tokens = seq_len.sum().clamp_min(1) if batch_num_tokens is None else batch_num_tokens
        return seq_sum.sum() / n_tokens
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_sum.sum() / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    if loss_agg_mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_len.clamp_min(1)
    else:
        raise ValueError(f"unknown loss_agg_mode '{loss_agg_mode}'; known: {', '.join(LOSS_AGG_MODES)}")
    n_seqs = (seq_len > 0).sum().clamp_min(1) if global_batch_size is None else global_batch_size
    return per_seq.sum() / n_seqs


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


# ---------------------------------------------------------------------------------
# Logits -> per-token quantities
# ---------------------------------------------------------------------------------


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


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(returns - values) / Var(returns) over valid positions (0-dim tensor).

    1 is a perfect critic, 0 no better than a constant, negative worse. The 1e-5 in the
    denominator follows verl's `critic/vf_explained_var`.
    """
    values, returns = _float(values), _float(returns)
    return 1.0 - masked_var(returns - values, mask) / (masked_var(returns, mask) + 1e-5)


# The outcome estimators of `rlhf.algos.outcome` (rloo, reinforce_plus_plus_baseline) register
# themselves in ADV_ESTIMATORS; importing it here makes the registry complete on `import algos`.
from rlhf.algos import outcome as algos_outcome  # noqa: E402,F401
