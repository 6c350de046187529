"""rlhf.algos on CPU, the losses and logits: hand-computed cases, chunked against plain
torch, and invariance to whatever sits at masked positions (cases and helpers of test_algos)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from rlhf.algos import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_advantages,
    compute_gae,
    compute_gae_advantage_return,
    compute_token_level_rewards,
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)
from test_algos import LN2, M, X, close, garble, t

# ---------------------------------------------------------------------------------
# agg_loss
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 non-empty sequences
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("token-sum", 7.0),  # 1 + 2 + 4
        ("seq-mean-token-sum-norm", 7 / 6),  # (3 + 4) / 2 sequences / T=3
    ],
)
def test_agg_loss_hand(mode, expected):
    close(agg_loss(t(X), t(M), mode), expected)  # row 3 is empty and ignored


def test_agg_loss_global_denominators():
    x, m = t(X), t(M)
    close(agg_loss(x, m, "token-mean", batch_num_tokens=7), 1.0)
    close(agg_loss(x, m, "seq-mean-token-sum", global_batch_size=4), 7 / 4)
    close(agg_loss(x, m, "seq-mean-token-mean", global_batch_size=11), 5.5 / 11)
    close(agg_loss(x, m, "seq-mean-token-sum-norm", loss_scale_factor=7), 0.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("denominators", [{}, {"batch_num_tokens": 23.0, "global_batch_size": 9.0, "loss_scale_factor": 5.0}])
def test_agg_loss_equals_verl(mode, denominators):
    """verl 0.9.1's own `agg_loss` (one data-parallel rank) on random losses with empty rows and
    garbage at masked positions."""
    from verl_reference import core_algos

    g = torch.Generator().manual_seed(7)
    loss_mat = torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) < 0.6).double()
    mask[2] = 0.0
    loss_mat = torch.where(mask.bool(), loss_mat, torch.full_like(loss_mat, 1e6))
    ours = agg_loss(loss_mat, mask, mode, **denominators)
    theirs = core_algos.agg_loss(loss_mat, mask, mode, **denominators)
    close(ours, float(theirs))


def test_agg_loss_all_masked_is_zero_and_unknown_mode_raises():
    for mode in LOSS_AGG_MODES:
        close(agg_loss(t(X), torch.zeros(3, 3), mode), 0.0)
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        agg_loss(t(X), t(M), "token-median")


# ---------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------

# clip_ratio_low 0.2, clip_ratio_high 0.28, clip_ratio_c 3; one token per branch
PG_ADV = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
PG_RATIO = [1.1, 1.5, 0.5, 0.5, 2.0, 4.0]
#           in range, clipped to 1.28, below (unclipped for A>0),
#           clipped to 0.8 (A<0), above (unclipped for A<0), dual clip to 3
PG_LOSSES = [-1.1, -1.28, -0.5, 0.8, 2.0, 3.0]
PG_GRAD = [-1.1, 0.0, -0.5, 0.0, 2.0, 0.0]  # d loss_i / d logprob_i = -A * ratio where unclipped


def _pg_inputs():
    logprob = t([[math.log(r) for r in PG_RATIO]]).requires_grad_(True)
    return logprob, torch.zeros(1, 6, dtype=torch.float64), t([PG_ADV]), torch.ones(1, 6)


def test_policy_loss_every_branch_hand():
    logprob, old, adv, mask = _pg_inputs()
    loss, metrics = policy_loss(logprob, old, adv, mask, 0.2, 0.28, 3.0)
    close(loss.detach(), sum(PG_LOSSES) / 6)
    loss.backward()
    close(logprob.grad, [[g / 6 for g in PG_GRAD]])
    close(metrics["pg_clipfrac"], 2 / 6)  # tokens 2 and 4
    close(metrics["pg_clipfrac_lower"], 1 / 6)  # token 6
    close(metrics["ppo_kl"], -sum(math.log(r) for r in PG_RATIO) / 6)
    assert not metrics["ppo_kl"].requires_grad


def test_policy_loss_per_token_values_via_masks():
    logprob, old, adv, _ = _pg_inputs()
    for i, expected in enumerate(PG_LOSSES):
        mask = torch.zeros(1, 6)
        mask[0, i] = 1
        loss, _ = policy_loss(logprob, old, adv, mask, 0.2, 0.28, 3.0)
        close(loss.detach(), expected)


def test_policy_loss_clamps_log_ratio_and_checks_dual_clip_bound():
    logprob = t([[50.0, 50.0]])
    loss, metrics = policy_loss(logprob, torch.zeros(1, 2), t([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.2, 3.0)
    assert torch.isfinite(loss)
    close(loss, (-1.2 + 3.0) / 2)
    close(metrics["ppo_kl"], -20.0)  # log ratio clamped at 20
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logprob, torch.zeros(1, 2), t([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.2, 1.0)


def test_policy_loss_agg_mode_is_passed_through():
    logprob, old, adv, _ = _pg_inputs()
    mask = t([[1, 1, 1, 1, 0, 0]])
    loss, _ = policy_loss(logprob, old, adv, mask, 0.2, 0.28, 3.0, loss_agg_mode="seq-mean-token-sum-norm")
    close(loss.detach(), sum(PG_LOSSES[:4]) / 6)


# ---------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------

# cliprange 0.2, old value 1.0 everywhere
VF_NEW = [1.1, 1.5, 1.5, 0.5]
VF_RET = [2.0, 2.0, 1.0, 0.0]
#   (1.1-2)^2 = .81 both;  clipped 1.2: .25 vs .64 -> .64;  clipped 1.2: .25 vs .04 -> .25;
#   clipped 0.8: .25 vs .64 -> .64
VF_LOSSES = [0.81, 0.64, 0.25, 0.64]


def test_value_loss_hand():
    values = t([VF_NEW]).requires_grad_(True)
    loss, metrics = value_loss(values, torch.ones(1, 4), t([VF_RET]), torch.ones(1, 4), 0.2)
    close(loss.detach(), 0.5 * sum(VF_LOSSES) / 4)
    loss.backward()
    # unclipped terms: 0.5 * 2 * (V - R) / 4; clipped terms have no gradient
    close(values.grad, [[(1.1 - 2.0) / 4, 0.0, (1.5 - 1.0) / 4, 0.0]])
    close(metrics["vf_clipfrac"], 0.5)
    close(metrics["vpred_mean"], 1.15)


# ---------------------------------------------------------------------------------
# Logits
# ---------------------------------------------------------------------------------


def test_entropy_hand():
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e9, -1e9], [1000.0, 0.0, 0.0, 0.0], [0, 0, float("-inf"), -math.inf]]]
    )
    h = entropy_from_logits(logits)
    assert h.shape == (1, 4) and h.dtype == torch.float32
    close(h, [[math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), 0.0, LN2]], tol=1e-5)


def test_entropy_matches_torch_and_chunks():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=gen) * 4 + 50
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=4), expected, atol=1e-5, rtol=0)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


def test_logprobs_hand():
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)], [1000.0, 0.0]]])
    labels = torch.tensor([[1, 0, 1]])
    close(logprobs_from_logits(logits, labels), [[math.log(0.75), math.log(0.25), -1000.0]], tol=1e-5)


def test_logprobs_match_log_softmax_with_grad_and_chunks():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 7, 13, generator=gen) * 3).requires_grad_(True)
    labels = torch.randint(0, 13, (2, 7), generator=gen)
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    for chunk in (None, 1, 5, 100):
        got = logprobs_from_logits(logits, labels, chunk_size=chunk)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        (grad,) = torch.autograd.grad(got.sum(), logits)
        torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------
# Explained variance
# ---------------------------------------------------------------------------------


def test_explained_variance_hand():
    ret, m = t([[1.0, 2.0, 3.0, 50.0]]), t([[1, 1, 1, 0]])
    close(explained_variance(t([[1.0, 2.0, 3.0, 0.0]]), ret, m), 1.0, tol=1e-4)  # perfect critic
    close(explained_variance(t([[2.0, 2.0, 2.0, 0.0]]), ret, m), 0.0, tol=1e-4)  # constant = mean
    # residuals -0.5, 0, 0.5: var 0.25 against var 1
    close(explained_variance(t([[1.5, 2.0, 2.5, 0.0]]), ret, m), 0.75, tol=1e-4)


# ---------------------------------------------------------------------------------
# Invariance: whatever sits at masked positions changes nothing
# ---------------------------------------------------------------------------------

INV_MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float64)


def _inv_inputs(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(4, 5, generator=gen, dtype=torch.float64) for _ in range(n)]


def _rewards(a, m):
    return compute_token_level_rewards(torch.arange(4.0), m, kl=a, kl_coef=0.3)


INVARIANCE_CASES = {
    "masked_mean": (1, lambda a, m: masked_mean(a, m)),
    "masked_mean_dim": (1, lambda a, m: masked_mean(a, m, dim=-1)),
    "masked_var": (1, lambda a, m: masked_var(a, m)),
    "masked_whiten": (1, lambda a, m: masked_whiten(a, m)),
    "compute_gae": (2, lambda a, b, m: compute_gae(a, b, m, 0.9, 0.8)),
    "compute_gae_advantage_return": (2, lambda a, b, m: compute_gae_advantage_return(a, b, m, 0.9, 0.8)),
    "compute_advantages_gae": (2, lambda a, b, m: compute_advantages("gae", a, m, values=b)),
    "compute_advantages_grpo": (1, lambda a, m: compute_advantages("grpo", a, m, group_ids=[0, 0, 1, 1])),
    "compute_token_level_rewards": (1, _rewards),
    "explained_variance": (2, lambda a, b, m: explained_variance(a, b, m)),
    **{f"agg_loss[{mode}]": (1, lambda a, m, mode=mode: agg_loss(a, m, mode)) for mode in LOSS_AGG_MODES},
    **{
        f"policy_loss[{mode}]": (3, lambda a, b, c, m, mode=mode: policy_loss(a, b, c, m, 0.2, 0.28, 3.0, mode))
        for mode in LOSS_AGG_MODES
    },
    "value_loss": (3, lambda a, b, c, m: value_loss(a, b, c, m, 0.2)),
}


def _flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.detach()]
    if isinstance(out, dict):
        return [torch.as_tensor(out[k]).detach() for k in sorted(out)]
    return [x for item in out for x in _flatten(item)]


@pytest.mark.parametrize("name", sorted(INVARIANCE_CASES))
@pytest.mark.parametrize("fill", [float("nan"), 1e6, -1e6])
def test_masked_positions_change_nothing(name, fill):
    n, fn = INVARIANCE_CASES[name]
    clean = _inv_inputs(n)
    dirty = [garble(x, INV_MASK, fill) for x in clean]
    want, got = _flatten(fn(*clean, INV_MASK)), _flatten(fn(*dirty, INV_MASK))
    assert len(want) == len(got) > 0
    for w, g in zip(want, got):
        assert torch.isfinite(g).all(), f"{name}: non-finite output"
        torch.testing.assert_close(g, w, atol=1e-9, rtol=0, equal_nan=False)


@pytest.mark.parametrize("name", ["policy_loss", "value_loss"])
def test_masked_positions_get_no_gradient(name):
    def run(first, rest):
        x = first.clone().requires_grad_(True)
        if name == "policy_loss":
            loss, _ = policy_loss(x, *rest, INV_MASK, 0.2, 0.2, 3.0)
        else:
            loss, _ = value_loss(x, *rest, INV_MASK, 0.2)
        (grad,) = torch.autograd.grad(loss, x)
        return grad

    clean = _inv_inputs(3)
    want = run(clean[0], clean[1:])
    got = run(garble(clean[0], INV_MASK, float("nan")), [garble(x, INV_MASK, float("nan")) for x in clean[1:]])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert (want[~INV_MASK.bool()] == 0).all() and (want[INV_MASK.bool()] != 0).any()
