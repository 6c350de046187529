"""rlhf.algos on CPU: hand-computed cases, invariance to masked positions, vectorised
code against plain Python loops, controller behaviour, registries."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf import algos
from rlhf.algos import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_advantages,
    compute_gae,
    compute_gae_advantage_return,
    compute_grpo_advantages,
    compute_token_level_rewards,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
)

LN2 = math.log(2.0)


def t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64), t(expected), atol=tol, rtol=0)


def garble(x: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """x with `fill` (NaN, huge) at masked positions."""
    return torch.where(mask.bool(), x, torch.full_like(x, fill))


# ---------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------

X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
M = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]


def test_masked_mean_hand():
    x, m = t(X), t(M)
    close(masked_mean(x, m), 7 / 3)  # (1 + 2 + 4) / 3
    close(masked_mean(x, m, dim=-1), [1.5, 4.0, 0.0])  # empty row -> 0
    close(masked_mean(x, m, dim=0), [2.5, 2.0, 0.0])


def test_masked_var_hand():
    x, m = t(X), t(M)
    # values 1, 2, 4; mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 14/3
    close(masked_var(x, m), 7 / 3)  # / (n - 1)
    close(masked_var(x, m, unbiased=False), 14 / 9)  # / n
    close(masked_var(x, m, dim=-1), [0.5, 0.0, 0.0])  # row 0: (0.25 + 0.25) / 1
    close(masked_var(t([[5.0, 1.0]]), t([[1, 0]])), 0.0)  # one element: no Bessel blow-up


def test_masked_whiten_hand():
    x, m = t([[1.0, 3.0, 100.0]]), t([[1, 1, 0]])
    # mean 2, unbiased var 2
    s = 1 / math.sqrt(2)
    close(masked_whiten(x, m), [[-s, s, 0.0]], tol=1e-6)
    close(masked_whiten(x, m, shift_mean=False), [[2 - s, 2 + s, 0.0]], tol=1e-6)


# ---------------------------------------------------------------------------------
# KL estimators and controllers
# ---------------------------------------------------------------------------------

# logprob = log 1/2 and ref = log 1/4, then the reverse.
LP = t([[math.log(0.5), math.log(0.25)]])
REF = t([[math.log(0.25), math.log(0.5)]])


@pytest.mark.parametrize(
    "kinds,expected",
    [
        (("kl", "k1"), [LN2, -LN2]),
        (("abs",), [LN2, LN2]),
        (("mse", "k2"), [0.5 * LN2**2, 0.5 * LN2**2]),
        # k3 = r - 1 - log r with r = p_ref / p: r = 1/2 then r = 2
        (("low_var_kl", "k3"), [0.5 - 1 + LN2, 2 - 1 - LN2]),
    ],
)
def test_kl_penalty_hand(kinds, expected):
    for kind in kinds:
        close(kl_penalty(LP, REF, kind), [expected], tol=1e-9)


def test_kl_estimators_are_zero_at_equal_policies():
    lp = t([[-0.3, -2.0, -7.0]])
    for kind in KL_ESTIMATORS.names():
        close(kl_penalty(lp, lp.clone(), kind), [[0.0, 0.0, 0.0]])


def test_k3_is_clamped_like_verl():
    # log r = 30 is clamped to 20 and e^20 - 21 to 10; log r = -30 -> -20 -> e^-20 + 19 -> 10
    lp = t([[0.0, -30.0]])
    ref = t([[-30.0, 0.0]])
    close(kl_penalty(lp, ref, "k3"), [[10.0, 10.0]])
    close(kl_penalty(t([[-1.0]]), t([[-4.0]]), "k3"), [[math.exp(-3) + 3 - 1]], tol=1e-9)


def test_fixed_controller_never_moves():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=10.0, n_steps=1000)
    assert ctrl.value == 0.05


@pytest.mark.parametrize(
    "current_kl,expected",
    [
        (0.11, 0.1 * (1 + 0.1 * 10 / 100)),  # error +10%: rises by 1%
        (0.15, 0.1 * (1 + 0.2 * 10 / 100)),  # error +50% clipped to +20%
        (5.00, 0.1 * (1 + 0.2 * 10 / 100)),  # any large KL: same cap
        (0.10, 0.1),  # on target: unchanged
        (0.09, 0.1 * (1 - 0.1 * 10 / 100)),  # error -10%: falls by 1%
        (0.00, 0.1 * (1 - 0.2 * 10 / 100)),  # error -100% clipped to -20%
    ],
)
def test_adaptive_controller_direction_and_clip(current_kl, expected):
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=current_kl, n_steps=10)
    assert ctrl.value == pytest.approx(expected, rel=1e-12)


def test_adaptive_controller_accepts_tensor_kl_and_compounds():
    ctrl = AdaptiveKLController(0.2, 0.05, 50)
    for _ in range(3):
        ctrl.update(torch.tensor(1.0), n_steps=5)
    assert ctrl.value == pytest.approx(0.2 * 1.02**3, rel=1e-12)


def test_controller_state_round_trip():
    ctrl = make_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=100)
    ctrl.update(0.5, 10)
    restored = make_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value != 0.1
    ctrl.update(0.01, 7)
    restored.update(0.01, 7)
    assert restored.value == ctrl.value
    fixed = make_kl_controller("fixed", 0.3)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3
    fixed.load_state_dict({"value": 0.7})
    assert fixed.value == 0.7


def test_controller_rejects_bad_settings():
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 10)
    with pytest.raises(KeyError, match="adaptive, fixed"):
        make_kl_controller("pid", 0.1)


# ---------------------------------------------------------------------------------
# Token-level rewards
# ---------------------------------------------------------------------------------


def test_token_level_rewards_place_score_on_last_valid_token():
    mask = t([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    rewards, metrics = compute_token_level_rewards(t([1.0, 2.0, 3.0, 4.0]), mask)
    close(rewards, [[0, 1, 0, 0], [0, 0, 0, 2], [0, 0, 3, 0], [0, 0, 0, 0]])
    assert metrics == {}


def test_token_level_rewards_subtract_kl():
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl = t([[0.1, 0.2, 9.0], [0.1, 0.1, 0.1], [5.0, 5.0, 5.0]])
    rewards, metrics = compute_token_level_rewards(t([1.0, 2.0, 3.0]), mask, kl=kl, kl_coef=0.5)
    close(rewards, [[-0.05, 1 - 0.1, 0], [-0.05, -0.05, 2 - 0.05], [0, 0, 0]])
    # per-response token means 0.15, 0.1, 0 (empty), averaged over responses
    assert metrics["reward_kl_penalty"] == pytest.approx(0.25 / 3)
    assert metrics["reward_kl_penalty_coeff"] == 0.5


# ---------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------

# gamma = 0.9, lam = 0.8 on a 3-token response, reward 1 at the end, V = 0.5, 0.6, 0.7:
#   t=2: delta = 1 - 0.7 = 0.3                A2 = 0.3
#   t=1: delta = 0.9 * 0.7 - 0.6 = 0.03       A1 = 0.03 + 0.72 * 0.3   = 0.246
#   t=0: delta = 0.9 * 0.6 - 0.5 = 0.04       A0 = 0.04 + 0.72 * 0.246 = 0.21712
GAE_ADV = [0.21712, 0.246, 0.3]
GAE_RET = [0.71712, 0.846, 1.0]


def test_gae_hand():
    adv, ret = compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), gamma=0.9, lam=0.8)
    close(adv, [GAE_ADV], tol=1e-9)
    close(ret, [GAE_RET], tol=1e-9)


def test_gae_hand_right_padding_and_middle_mask():
    rewards = t([[0.0, 0.0, 1.0, 5.0], [0.0, 7.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 0.7, 9.0], [0.5, 99.0, 0.6, 0.7]])
    mask = t([[1, 1, 1, 0], [1, 0, 1, 1]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [GAE_ADV + [0.0], [GAE_ADV[0], 0.0, GAE_ADV[1], GAE_ADV[2]]], tol=1e-9)
    close(ret, [GAE_RET + [0.0], [GAE_RET[0], 0.0, GAE_RET[1], GAE_RET[2]]], tol=1e-9)


def test_gae_special_cases_hand():
    r, v, m = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]])
    adv, ret = compute_gae(r, v, m, gamma=1.0, lam=1.0)  # Monte Carlo: return = reward-to-go
    close(adv, [[0.5, 0.4, 0.3]], tol=1e-9)
    close(ret, [[1.0, 1.0, 1.0]], tol=1e-9)
    adv, _ = compute_gae(r, v, m, gamma=0.9, lam=0.0)  # one-step TD errors
    close(adv, [[0.04, 0.03, 0.3]], tol=1e-9)


def gae_reference(rewards, values, mask, gamma, lam):
    """Textbook GAE with Python floats on each response's valid tokens only."""
    adv = [[0.0] * len(row) for row in rewards]
    for b in range(len(rewards)):
        idx = [i for i, m in enumerate(mask[b]) if m]
        last_gae, next_value = 0.0, 0.0
        for i in reversed(idx):
            delta = rewards[b][i] + gamma * next_value - values[b][i]
            last_gae = delta + gamma * lam * last_gae
            next_value = values[b][i]
            adv[b][i] = last_gae
    ret = [[(a + v) if m else 0.0 for a, v, m in zip(*row)] for row in zip(adv, values, mask)]
    return adv, ret


def _random_masks(gen: torch.Generator, B: int, T: int) -> list[torch.Tensor]:
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    right_padded = (torch.arange(T)[None, :] < lengths[:, None]).double()
    holes = (torch.rand(B, T, generator=gen) < 0.7).double()
    return [torch.ones(B, T, dtype=torch.float64), right_padded, holes]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.3)])
def test_gae_matches_python_loop(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    B, T = 5, 9
    for mask in _random_masks(gen, B, T):
        rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
        values = torch.randn(B, T, generator=gen, dtype=torch.float64)
        adv, ret = compute_gae(rewards, values, mask, gamma, lam)
        ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        close(adv, ref_adv, tol=1e-10)
        close(ret, ref_ret, tol=1e-10)


@settings(max_examples=25, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.floats(-3, 3), st.floats(-3, 3), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_gae_property_matches_python_loop(data, gamma, lam):
    rewards = [[d[0] for d in data]]
    values = [[d[1] for d in data]]
    mask = [[1.0 if d[2] else 0.0 for d in data]]
    adv, ret = compute_gae(t(rewards), t(values), t(mask), gamma, lam)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    close(adv, ref_adv, tol=1e-9)
    close(ret, ref_ret, tol=1e-9)


def test_gae_advantage_return_whitens_advantages_only():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    values = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = t([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.95)
    raw_adv, raw_ret = compute_gae(rewards, values, mask, 0.9, 0.95)
    close(ret, raw_ret.tolist(), tol=1e-12)
    close(masked_mean(adv, mask), 0.0, tol=1e-9)
    close(masked_var(adv, mask), 1.0, tol=1e-6)
    # whitening is affine: same order, same ratios of centred values
    valid = mask.bool()
    centred = raw_adv[valid] - raw_adv[valid].mean()
    close(adv[valid], (centred / raw_adv[valid].std()).tolist(), tol=1e-6)


# ---------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------

GRPO_SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
# group a: 1, 0, 0 -> mean 1/3, unbiased std sqrt(1/3); group b: 1, 1 -> std 0;
# group c: a single response -> mean 0, std 1 (verl)
S3 = math.sqrt(1 / 3)
GRPO_NORMED = [(2 / 3) / S3, (-1 / 3) / S3, (-1 / 3) / S3, 0.0, 0.0, 0.5]
GRPO_CENTRED = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.5]


@pytest.mark.parametrize(
    "group_ids",
    [[0, 0, 0, 1, 1, 2], ["a", "a", "a", "b", "b", "c"], torch.tensor([7, 7, 7, 3, 3, 5]), np.array([9, 9, 9, 1, 1, 4])],
)
def test_grpo_hand(group_ids):
    mask = torch.ones(6, 2)
    adv, ret = compute_grpo_advantages(t(GRPO_SCORES), group_ids, mask)
    close(adv[:, 0], GRPO_NORMED, tol=1e-5)
    close(adv[:, 1], GRPO_NORMED, tol=1e-5)
    assert torch.equal(adv, ret)
    adv, _ = compute_grpo_advantages(t(GRPO_SCORES), group_ids, mask, norm_by_std=False)
    close(adv[:, 0], GRPO_CENTRED, tol=1e-12)


def test_grpo_broadcasts_over_valid_tokens_only():
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    adv, _ = compute_grpo_advantages(t([1.0, 3.0, 2.0, 2.0]), [0, 0, 1, 1], mask, norm_by_std=False)
    close(adv, [[-1, -1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_grpo_interleaved_groups_match_python_loop():
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(12, generator=gen, dtype=torch.float64)
    ids = [3, 1, 3, 2, 1, 3, 2, 2, 1, 0, 3, 0]
    adv, _ = compute_grpo_advantages(scores, ids, torch.ones(12, 1), epsilon=1e-6)
    for i, gid in enumerate(ids):
        group = [scores[j].item() for j, g in enumerate(ids) if g == gid]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        assert adv[i, 0].item() == pytest.approx((scores[i].item() - mean) / (std + 1e-6), rel=1e-9)


def test_grpo_rejects_mismatched_group_ids():
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        compute_grpo_advantages(t([1.0, 2.0, 3.0]), [0, 0], torch.ones(3, 2))


def test_adv_estimators_dispatch():
    mask = t([[1, 1, 0], [1, 1, 1]])
    token_rewards = t([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]])
    adv, _ = compute_advantages("grpo", token_rewards, mask, group_ids=[0, 0], norm_by_std=False)
    close(adv, [[0.25, 0.25, 0], [-0.25, -0.25, -0.25]])  # totals 1 and 0.5, mean 0.75
    values = t([[0.1, 0.2, 0.3], [0.3, 0.2, 0.1]])
    adv, ret = compute_advantages("gae", token_rewards, mask, values=values, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = compute_gae_advantage_return(token_rewards, values, mask, 0.9, 0.8)
    assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages("gae", token_rewards, mask)
    with pytest.raises(ValueError, match="needs group_ids"):
        compute_advantages("grpo", token_rewards, mask)


# ---------------------------------------------------------------------------------
# Registries
# ---------------------------------------------------------------------------------


def test_registries_hold_the_documented_names():
    assert set(KL_ESTIMATORS.names()) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert set(ADV_ESTIMATORS.names()) == {"gae", "grpo", "rloo", "reinforce_plus_plus_baseline"}
    assert KL_ESTIMATORS.get("kl") is KL_ESTIMATORS.get("k1")
    assert KL_ESTIMATORS.get("low_var_kl") is KL_ESTIMATORS.get("k3")


def test_registries_reject_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        KL_ESTIMATORS.add("k1", lambda lp, ref: lp)
    with pytest.raises(ValueError, match="already registered"):
        ADV_ESTIMATORS.register("gae")(lambda *a, **k: None)
    assert ADV_ESTIMATORS.get("gae") is algos.gae_estimator


def test_unknown_names_list_known_ones():
    lp = t([[0.0]])
    with pytest.raises(KeyError, match="abs, k1, k2, k3, kl, low_var_kl, mse"):
        kl_penalty(lp, lp, "k4")
    with pytest.raises(KeyError, match="gae, grpo, reinforce_plus_plus_baseline, rloo"):
        compute_advantages("vtrace", lp, torch.ones(1, 1))
