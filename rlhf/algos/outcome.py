"""Outcome-reward advantage estimators with a group baseline: RLOO and REINFORCE++-baseline.

Names and semantics follow verl's `core_algos.py` (`algorithm.adv_estimator=rloo`,
`reinforce_plus_plus_baseline`). Both read a response's total reward, the sum of its
token-level rewards (score minus any in-reward KL penalty), as GRPO does, and register
in `rlhf.algos.advantages.ADV_ESTIMATORS`. Tensors are (B, T) with a 0/1 `response_mask`.

- RLOO (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740): each response's
  baseline is the mean reward of the *other* responses to its prompt,
      A_i = R_i - 1/(n-1) sum_{j != i} R_j = n/(n-1) (R_i - mean_group(R)),
  broadcast over the response tokens. A group of one keeps its raw reward (verl).
- REINFORCE++-baseline (Hu 2025, arXiv:2501.03262, OpenRLHF's recommendation for rule
  rewards): subtract the group mean (0 for a group of one), broadcast over the tokens,
  then whiten over all valid tokens of the batch.

As everywhere in `rlhf.algos`, masked positions never reach a result and are 0 on output.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rlhf.algos.advantages import ADV_ESTIMATORS, GroupIds, _group_index
from rlhf.algos.masked import _float, _zero_masked, masked_whiten

Tensor = torch.Tensor


def _totals_and_groups(token_level_rewards: Tensor, reward_mask: Tensor, group_ids: Optional[GroupIds],
                       name: str) -> tuple[Tensor, Tensor, Tensor]:
    """(R (B,), group index (B,), group sizes (G,)) of a batch; R sums over `reward_mask`."""
    if group_ids is None:
        raise ValueError(f"advantage estimator '{name}' needs group_ids (one id per prompt's group of responses)")
    totals = _float(_zero_masked(token_level_rewards, reward_mask)).sum(-1)  # (B,)
    group = _group_index(group_ids, totals.shape[0], totals.device)  # (B,)
    return totals, group, torch.bincount(group).to(totals.dtype)


def _group_mean(totals: Tensor, group: Tensor, count: Tensor) -> Tensor:
    """(B,) each row's group mean."""
    return (torch.zeros_like(count).index_add_(0, group, totals) / count)[group]


@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards: Tensor, response_mask: Tensor, group_ids: GroupIds,
                                   reward_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """RLOO advantages: R_i minus the mean of the other responses of its group.

    token_level_rewards, response_mask: (B, T); group_ids: (B,); R_i sums the rewards over
    `reward_mask` (default response_mask). Returns (advantages, returns), both (B, T),
    equal, 0 at masked positions.
    """
    totals_mask = response_mask if reward_mask is None else reward_mask
    totals, group, count = _totals_and_groups(token_level_rewards, totals_mask, group_ids, "rloo")
    n = count[group]  # (B,)
    loo = (totals - _group_mean(totals, group, count)) * n / (n - 1).clamp_min(1)
    adv = torch.where(n > 1, loo, totals)
    advantages = _zero_masked(adv.unsqueeze(-1).expand(response_mask.shape), response_mask)
    return advantages, advantages.clone()


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, group_ids: GroupIds,
    whiten: Callable[[Tensor, Tensor], Tensor] = masked_whiten, reward_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: (R_i - group mean), broadcast over tokens, whitened over the batch.

    token_level_rewards, response_mask: (B, T); group_ids: (B,). `whiten(x, mask)` whitens
    over valid tokens (the trainer passes one over all ranks); R_i sums over `reward_mask`
    (default response_mask). Returns (advantages, returns), both (B, T), equal, 0 at
    masked positions.
    """
    totals_mask = response_mask if reward_mask is None else reward_mask
    totals, group, count = _totals_and_groups(token_level_rewards, totals_mask, group_ids,
                                              "reinforce_plus_plus_baseline")
    mean = torch.where(count[group] > 1, _group_mean(totals, group, count), torch.zeros_like(totals))
    tiled = _zero_masked((totals - mean).unsqueeze(-1).expand(response_mask.shape), response_mask)
    advantages = _zero_masked(whiten(tiled, response_mask), response_mask)
    return advantages, advantages.clone()


@ADV_ESTIMATORS.register("rloo")
def rloo_estimator(token_level_rewards: Tensor, response_mask: Tensor, *, values: Optional[Tensor] = None,
                   group_ids: Optional[GroupIds] = None, gamma: float = 1.0, lam: float = 1.0,
                   norm_by_std: bool = True, whiten: Callable[[Tensor, Tensor], Tensor] = masked_whiten,
                   reward_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """RLOO on each response's total reward (critic values, gamma, lam and whitening unused)."""
    return compute_rloo_outcome_advantage(token_level_rewards, response_mask, group_ids, reward_mask)


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_pp_baseline_estimator(token_level_rewards: Tensor, response_mask: Tensor, *,
                                    values: Optional[Tensor] = None, group_ids: Optional[GroupIds] = None,
                                    gamma: float = 1.0, lam: float = 1.0, norm_by_std: bool = True,
                                    whiten: Callable[[Tensor, Tensor], Tensor] = masked_whiten,
                                    reward_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline on each response's total reward, whitened by `whiten`."""
    return compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, group_ids,
                                                                  whiten, reward_mask)
