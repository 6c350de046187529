"""RLOO and REINFORCE++-baseline: hand cases, masked-position invariance, and verl 0.9.1's
own `core_algos` estimators on the same inputs (GRPO too, after rollout rejection)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf.algos import ADV_ESTIMATORS, compute_advantages
from rlhf.algos.outcome import (compute_reinforce_plus_plus_baseline_outcome_advantage,
                                compute_rloo_outcome_advantage)
from tests.verl_reference import core_algos

VERL = {"grpo": core_algos.compute_grpo_outcome_advantage, "rloo": core_algos.compute_rloo_outcome_advantage,
        "reinforce_plus_plus_baseline": core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage}


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def outcome(scores, width=3):
    """Token-level rewards with each score on the last of `width` valid tokens."""
    r = torch.zeros(len(scores), width, dtype=torch.float64)
    r[:, -1] = t(scores)
    return r, torch.ones(len(scores), width, dtype=torch.float64)


def test_rloo_hand_case():
    # Group 0: scores 1, 0, 0 -> baselines 0, 0.5, 0.5 -> 1, -0.5, -0.5. Group 1 (one response): raw 2.
    r, m = outcome([1.0, 0.0, 0.0, 2.0])
    adv, ret = compute_rloo_outcome_advantage(r, m, [0, 0, 0, 1])
    assert torch.allclose(adv[:, 0], t([1.0, -0.5, -0.5, 2.0]))
    assert torch.equal(adv, ret) and torch.allclose(adv, adv[:, :1].expand_as(adv))


def test_reinforce_pp_baseline_hand_case():
    # Group means 0.5 and 1.0 -> centred 0.5, -0.5, 0, 0 per token (3 tokens each); whitened:
    # mean 0, unbiased std over the 12 tokens = sqrt(6 * 0.25 / 11).
    r, m = outcome([1.0, 0.0, 1.0, 1.0])
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, [0, 0, 1, 1])
    std = (6 * 0.25 / 11) ** 0.5
    assert torch.allclose(adv[:, 0], t([0.5, -0.5, 0.0, 0.0]) / std, atol=1e-6)


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline", "grpo"])
def test_estimators_match_verl(name):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(12, 5, generator=g) > 0.3).double()
    mask[:, 0] = 1
    index = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4]
    ours, _ = compute_advantages(name, rewards * mask, mask, group_ids=index)
    ref, _ = VERL[name](token_level_rewards=rewards * mask, response_mask=mask, index=np.array(index))
    assert torch.allclose(ours, ref * mask, atol=1e-6)


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline", "grpo"])
def test_rejected_responses_keep_their_place_in_the_group_baseline(name):
    """After rollout rejection verl passes the rejected mask but sums each response's rewards
    over all its tokens, so a rejected response still counts in its group's mean (and std):
    `reward_mask` (the mask before rejection) gives the same."""
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(8, 4, dtype=torch.float64)
    rewards = torch.randn(8, 4, generator=g, dtype=torch.float64)
    keep = mask.clone()
    keep[1] = 0  # response 1 rejected whole
    keep[5, 2:] = 0  # response 5 loses its last tokens (where the outcome reward sits)
    index = [0, 0, 0, 0, 1, 1, 1, 1]
    ours, _ = compute_advantages(name, rewards, keep, group_ids=index, reward_mask=mask)
    ref, _ = VERL[name](token_level_rewards=rewards, response_mask=keep, index=np.array(index))
    assert torch.allclose(ours, ref * keep, atol=1e-6)
    dropped, _ = compute_advantages(name, rewards, keep, group_ids=index)  # totals over the kept tokens only
    assert not torch.allclose(dropped, ours, atol=1e-3)


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline"])
def test_estimators_ignore_masked_positions(name):
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(6, 4, generator=g, dtype=torch.float64)
    mask = t([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1]])
    garbage = torch.where(mask.bool(), rewards, t(float("nan")))
    ids = [0, 0, 0, 1, 1, 1]
    a, _ = compute_advantages(name, rewards, mask, group_ids=ids)
    b, _ = compute_advantages(name, garbage, mask, group_ids=ids)
    assert torch.equal(a, b) and torch.all(a[mask == 0] == 0)


def test_estimators_need_group_ids_and_names_are_unique():
    r, m = outcome([1.0, 0.0])
    for name in ("rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match="needs group_ids"):
            compute_advantages(name, r, m)
        with pytest.raises(ValueError, match="already registered"):
            ADV_ESTIMATORS.add(name, lambda *a, **k: None)


def test_in_reward_kl_reaches_every_group_estimator():
    """The estimators read the summed token-level rewards: a KL penalty on one response's
    tokens changes its advantage (the split that dropped GRPO's in-reward KL cannot recur)."""
    r, m = outcome([1.0, 1.0, 0.0, 0.0])
    penalised = r.clone()
    penalised[0] -= 0.1  # kl_coef * KL on each of response 0's three tokens
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        a, _ = compute_advantages(name, r, m, group_ids=[0, 0, 0, 0])
        b, _ = compute_advantages(name, penalised, m, group_ids=[0, 0, 0, 0])
        assert b[0, 0] < a[0, 0], name
