"""Rollout correction (`rlhf.algos.correction`): IS weights, the cap, rejection, the veto and
the metrics, against hand values and verl's definitions; and the no-op when the rollout and
trainer log-probs agree."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algos import policy_loss
from rlhf.algos.correction import compute_rollout_correction, mismatch_metrics


def t(x):
    return torch.tensor(x, dtype=torch.float64)


LN = math.log
# Two responses of 3 tokens; the second has 2 valid ones. log rho = old - rollout per token.
MASK = t([[1, 1, 1], [1, 1, 0]])
OLD = t([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
ROLL = OLD - t([[LN(1.5), LN(4.0), LN(0.5)], [LN(0.9), LN(1.1), 5.0]])  # rho 1.5, 4, 0.5 | 0.9, 1.1


def test_rollout_correction_token_weights_and_cap():
    corr, m = compute_rollout_correction(OLD, ROLL, MASK, rollout_is="token", rollout_is_threshold=2.0)
    assert torch.allclose(corr.weights, t([[1.5, 2.0, 0.5], [0.9, 1.1, 0.0]]))  # 4 capped at 2; pad 0
    assert torch.equal(corr.mask, MASK)  # no rejection configured
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((1.5 + 2 + 0.5 + 0.9 + 1.1) / 5)
    assert m["rollout_corr/rollout_is_weights_max"] == pytest.approx(2.0)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(4.0)  # before the cap, as verl logs it
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 5)


def test_rollout_correction_sequence_weights():
    corr, m = compute_rollout_correction(OLD, ROLL, MASK, rollout_is="sequence", rollout_is_threshold=5.0)
    w0, w1 = 1.5 * 4.0 * 0.5, 0.9 * 1.1  # products over valid tokens: 3.0 and 0.99
    assert torch.allclose(corr.weights, t([[w0] * 3, [w1, w1, 0.0]]))
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((w0 + w1) / 2)  # one weight per response
    capped, _ = compute_rollout_correction(OLD, ROLL, MASK, rollout_is="sequence", rollout_is_threshold=2.0)
    assert torch.allclose(capped.weights[0], t([2.0] * 3))


def test_rollout_correction_batch_normalize_and_ess():
    corr, m = compute_rollout_correction(OLD, ROLL, MASK, rollout_is="token", rollout_is_threshold=10.0,
                                         rollout_is_batch_normalize=True)
    w = t([1.5, 4.0, 0.5, 0.9, 1.1])
    assert torch.allclose(corr.weights[MASK.bool()], w / w.mean())
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(float(1 / ((w / w.mean()) ** 2).mean()))


def test_rollout_correction_rejection_levels():
    # token: band [1/2, 2] drops the token with rho 4 (0.5 is on the edge and kept).
    corr, m = compute_rollout_correction(OLD, ROLL, MASK, rollout_is=None, rollout_rs="token", rollout_rs_threshold=2.0)
    assert torch.equal(corr.mask, t([[1, 0, 1], [1, 1, 0]]))
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert torch.equal(corr.weights, MASK)  # IS off: weights are the mask
    # sequence: products 3.0 (out of [1/2, 2]) and 0.99 (in) -> response 0 dropped whole.
    corr, _ = compute_rollout_correction(OLD, ROLL, MASK, rollout_is=None, rollout_rs="sequence",
                                         rollout_rs_threshold=2.0)
    assert torch.equal(corr.mask, t([[0, 0, 0], [1, 1, 0]]))
    # geometric: 3.0 ** (1/3) = 1.44 and 0.99 ** (1/2) = 0.995; band [0.999, 1.001] drops both.
    corr, _ = compute_rollout_correction(OLD, ROLL, MASK, rollout_is=None, rollout_rs="geometric",
                                         rollout_rs_threshold=1.5, rollout_rs_threshold_lower=0.99)
    assert torch.equal(corr.mask, MASK)
    corr, _ = compute_rollout_correction(OLD, ROLL, MASK, rollout_is=None, rollout_rs="geometric",
                                         rollout_rs_threshold=1.001, rollout_rs_threshold_lower=0.999)
    assert torch.equal(corr.mask, torch.zeros_like(MASK))


def test_rollout_correction_veto_drops_a_response_with_one_catastrophic_token():
    roll = ROLL.clone()
    roll[1, 0] = OLD[1, 0] - LN(1e-5)  # rho = 1e-5 on one token of response 1
    corr, m = compute_rollout_correction(OLD, roll, MASK, rollout_is="token", rollout_token_veto_threshold=1e-4)
    assert torch.equal(corr.mask, t([[1, 1, 1], [0, 0, 0]]))
    assert m["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(0.5)


def test_rollout_correction_mismatch_metrics():
    m = mismatch_metrics(OLD, ROLL, MASK)
    d = t([LN(1.5), LN(4.0), LN(0.5), LN(0.9), LN(1.1)])  # |old - rollout| = |log rho|
    assert m["rollout_corr/log_prob_abs_diff_mean"] == pytest.approx(float(d.abs().mean()))
    assert m["rollout_corr/log_prob_abs_diff_max"] == pytest.approx(LN(4.0))
    assert m["rollout_corr/kl"] == pytest.approx(float(-d.mean()))  # mean log(pi_rollout / pi_old)
    rho = d.exp()
    assert m["rollout_corr/k3_kl"] == pytest.approx(float((rho - 1 - d).mean()))
    p_diff = (OLD.exp() - ROLL.clamp(max=0).exp()).abs()[MASK.bool()]
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(float(p_diff.mean()))


def test_rollout_correction_ignores_masked_positions():
    junk_old, junk_roll = OLD.clone(), ROLL.clone()
    junk_old[1, 2], junk_roll[1, 2] = float("nan"), float("inf")
    for kw in (dict(rollout_is="token"), dict(rollout_is="sequence", rollout_rs="geometric", rollout_rs_threshold=2.0),
               dict(rollout_is="token", rollout_rs="sequence", rollout_rs_threshold=4.0, rollout_token_veto_threshold=1e-3)):
        a, ma = compute_rollout_correction(OLD, ROLL, MASK, **kw)
        b, mb = compute_rollout_correction(junk_old, junk_roll, MASK, **kw)
        assert torch.equal(a.weights, b.weights) and torch.equal(a.mask, b.mask)
        assert ma == mb


def test_rollout_correction_changes_nothing_when_log_probs_agree():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(4, 6, generator=g) > 0.2).double()
    new_lp = lp + 0.05 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=g, dtype=torch.float64)
    plain, _ = policy_loss(new_lp, lp, adv, mask, 0.2, 0.2)
    for kw in (dict(rollout_is="token"), dict(rollout_is="sequence", rollout_rs="sequence"),
               dict(rollout_is="token", rollout_rs="geometric", rollout_rs_threshold=1.001,
                    rollout_token_veto_threshold=1e-4)):
        corr, m = compute_rollout_correction(lp, lp.clone(), mask, **kw)
        assert torch.equal(corr.weights, mask) and torch.equal(corr.mask, mask)
        loss, _ = policy_loss(new_lp, lp, adv, corr.mask, 0.2, 0.2, rollout_is_weights=corr.weights)
        assert torch.equal(loss, plain)
        assert m["rollout_corr/kl"] == 0 and m["rollout_corr/log_prob_abs_diff_max"] == 0
        assert m.get("rollout_corr/rollout_is_ratio_fraction_high", 0.0) == 0


def test_rollout_correction_weights_scale_the_policy_loss_per_token():
    """The weights multiply the per-token surrogate (verl: pg_losses * rollout_is_weights)."""
    lp = t([[-1.0, -2.0]])
    mask = t([[1, 1]])
    adv = t([[1.0, -2.0]])
    w = t([[0.5, 2.0]])
    loss, _ = policy_loss(lp, lp, adv, mask, 0.2, 0.2, rollout_is_weights=w)
    assert float(loss) == pytest.approx((-1.0 * 0.5 + 2.0 * 2.0) / 2)  # ratio 1: -A per token, weighted


def test_rollout_correction_bad_settings_raise():
    with pytest.raises(ValueError, match="rollout_is must be one of"):
        compute_rollout_correction(OLD, ROLL, MASK, rollout_is="geometric")
    with pytest.raises(ValueError, match="rollout_rs must be one of"):
        compute_rollout_correction(OLD, ROLL, MASK, rollout_rs="tokens")
    with pytest.raises(ValueError, match="lower <= upper"):
        compute_rollout_correction(OLD, ROLL, MASK, rollout_rs="token", rollout_rs_threshold=2.0,
                                   rollout_rs_threshold_lower=3.0)
