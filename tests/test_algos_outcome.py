"""RLOO and REINFORCE++-baseline: hand cases, masked-position invariance, and verl's formula
as its `core_algos.py` states it (a per-group Python loop, re-written here as the reference)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from rlhf.algos import ADV_ESTIMATORS, compute_advantages, masked_whiten
from rlhf.algos.outcome import (compute_reinforce_plus_plus_baseline_outcome_advantage,
                                compute_rloo_outcome_advantage)


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def outcome(scores, width=3):
    """Token-level rewards with each score on the last of `width` valid tokens."""
    r = torch.zeros(len(scores), width, dtype=torch.float64)
    r[:, -1] = t(scores)
    return r, torch.ones(len(scores), width, dtype=torch.float64)


def verl_rloo(token_level_rewards, response_mask, index):
    """verl's compute_rloo_outcome_advantage, step by step: per group mean; for a group of
    n > 1, score * n/(n-1) - mean * n/(n-1); a group of one keeps its score."""
    scores = token_level_rewards.sum(dim=-1).clone()
    id2score, id2mean = defaultdict(list), {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx, vals in id2score.items():
        id2mean[idx] = torch.tensor(0.0, dtype=scores.dtype) if len(vals) == 1 else torch.mean(torch.stack(vals))
    for i in range(len(scores)):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


def verl_rfpp_baseline(token_level_rewards, response_mask, index):
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage: subtract the group mean
    (0 for a group of one), tile over the response, masked_whiten over the batch, times mask."""
    scores = token_level_rewards.sum(dim=-1).clone()
    id2score, id2mean = defaultdict(list), {}
    for i in range(len(scores)):
        id2score[index[i]].append(scores[i])
    for idx, vals in id2score.items():
        id2mean[idx] = torch.tensor(0.0, dtype=scores.dtype) if len(vals) == 1 else torch.mean(torch.stack(vals))
    for i in range(len(scores)):
        scores[i] = scores[i] - id2mean[index[i]]
    tiled = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
    return masked_whiten(tiled, response_mask) * response_mask


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


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline"])
def test_estimators_match_verl_formula(name):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(12, 5, generator=g) > 0.3).double()
    mask[:, 0] = 1
    index = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4]
    ours, _ = compute_advantages(name, rewards * mask, mask, group_ids=index)
    ref = verl_rloo(rewards * mask, mask, index) if name == "rloo" else verl_rfpp_baseline(rewards * mask, mask, index)
    assert torch.allclose(ours, ref, atol=1e-6)


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
