"""Token-level rewards and advantage estimators: GAE, GRPO and the `ADV_ESTIMATORS` registry
that `compute_advantages` dispatches on (`algorithm.adv_estimator`).

Every estimator in the registry takes `(token_level_rewards, response_mask, *, values,
group_ids, gamma, lam, norm_by_std, whiten, reward_mask)` and returns `(advantages,
returns)`, each (B, T) and 0 at masked positions. After rollout rejection `response_mask`
is the mask with the rejected tokens removed, while `reward_mask` (default: the same) is
the mask before rejection: the outcome estimators sum a response's rewards over it, so a
rejected response still counts in its group's baseline, as in verl (whose estimators sum
`token_level_rewards` over every position). `rlhf.algos.outcome` registers RLOO and
REINFORCE++-baseline here.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from rlhf.algos.masked import _float, _zero_masked, masked_mean, masked_whiten
from rlhf.config.registry import Registry

Tensor = torch.Tensor
GroupIds = Union[Tensor, np.ndarray, Sequence[Any]]


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
    reward_mask: Optional[Tensor] = None,
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
    reward_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """GRPO on each response's total reward (score plus any in-reward KL, summed over
    `reward_mask`), as verl."""
    if group_ids is None:
        raise ValueError("advantage estimator 'grpo' needs group_ids (one id per prompt's group of responses)")
    totals_mask = response_mask if reward_mask is None else reward_mask
    scores = _zero_masked(token_level_rewards, totals_mask).sum(-1)  # (B,)
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
    reward_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns), each (B, T), from the estimator named `adv_estimator`.

    Every estimator reads `token_level_rewards` (score minus any in-reward KL), so the KL
    penalty reaches the advantages whichever estimator is chosen. `whiten(x, mask)` is the
    batch whitening of the estimators that whiten (gae, reinforce_plus_plus_baseline); the
    trainer passes one that reduces over all ranks. `reward_mask`: see the module docstring.
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
        reward_mask=reward_mask,
    )
