"""Rollout correction (`rlhf.algos.correction`, `rlhf.algos.rejection`, the bypass-mode loss,
`rlhf.config.correction`) against verl 0.9.1's own functions on the same random batches
(groups, uneven lengths, garbage at padded positions): weights, masks and every metric, for
every rejection criterion, threshold form and preset; plus the config's threshold strings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf.algos import policy_loss
from rlhf.algos.correction import bypass_policy_loss, compute_rollout_correction
from rlhf.algos.mismatch import probs_diff_metrics
from rlhf.config import ConfigError, load_config
from rlhf.config.correction import ROLLOUT_CORRECTION_PRESETS, correction_settings
from rlhf.config.correction_spec import CRITERIA
from tests import verl_reference as V

OFF = dict(rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False, rollout_rs=None,
           rollout_rs_threshold=None)
# Thresholds that reject some but not all of `V.batch`'s tokens, per divergence.
RS_THRESHOLD = {"k1": "0.7_1.3", "k2": "0.03", "k3": "0.03"}
SEQ_THRESHOLD = {"seq_sum_k1": "0.3_3.0", "seq_sum_k2": "0.15", "seq_sum_k3": "0.15", "seq_mean_k2": "0.04",
                 "seq_mean_k3": "0.04", "seq_max_k2": "0.2", "seq_max_k3": "0.2"}
CASES = {
    **{f"rs-{c}": dict(rollout_rs=c, rollout_rs_threshold=SEQ_THRESHOLD.get(c, RS_THRESHOLD[c[-2:]]))
       for c in CRITERIA},
    "rs-k1-single-number": dict(rollout_rs="token_k1", rollout_rs_threshold=1.3),  # lower = 1 / 1.3
    "rs-k1-uneven-bounds": dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.95_1.3"),
    "rs-chained-one-threshold": dict(rollout_rs="token_k2,seq_max_k3,seq_mean_k2", rollout_rs_threshold=0.05),
    "rs-chained-per-criterion": dict(rollout_rs="token_k1, seq_mean_k3,seq_max_k2,token_k1",
                                     rollout_rs_threshold="0.6_1.4,0.05,0.3"),
    "is-token-tis": dict(rollout_is="token", rollout_is_threshold=1.5),
    "is-token-tis-string": dict(rollout_is="token", rollout_is_threshold="1.5"),
    "is-sequence-tis": dict(rollout_is="sequence", rollout_is_threshold=2.0),
    "is-token-icepop": dict(rollout_is="token", rollout_is_threshold="0.8_1.25"),
    "is-sequence-icepop": dict(rollout_is="sequence", rollout_is_threshold="0.5_2"),
    "is-token-normalized": dict(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True),
    "is-sequence-normalized": dict(rollout_is="sequence", rollout_is_threshold="0.2_5.0",
                                   rollout_is_batch_normalize=True),
    "is-threshold-null": dict(rollout_is="token", rollout_is_threshold=None),
    "is-and-rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1,token_k3",
                      rollout_rs_threshold="0.5_2.0,0.05"),
    "metrics-only": dict(),
}


def assert_same(ours_corr, ours_metrics, verl_out, where: str) -> None:
    """Weights (to rounding), mask (exactly) and every metric verl logs, with its value."""
    w, mask, metrics = verl_out
    assert torch.equal(ours_corr.mask, mask), where
    if w is None:
        assert ours_corr.weights is None, where
    else:
        assert torch.allclose(ours_corr.weights, w.batch["rollout_is_weights"], rtol=1e-6, atol=1e-12), where
    missing = sorted(set(metrics) - set(ours_metrics))
    assert not missing, f"{where}: verl logs {missing}"
    wrong = {k: (ours_metrics[k], float(v)) for k, v in metrics.items() if not V.close(ours_metrics[k], float(v))}
    assert not wrong, f"{where}: (ours, verl) {wrong}"


@pytest.mark.parametrize("case", list(CASES))
def test_correction_equals_verl(case):
    kw = {**OFF, **CASES[case]}
    rejected = 0.0
    for seed in range(3):
        b = V.batch(seed)
        args = (b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
        corr, metrics = compute_rollout_correction(*args, **kw)
        assert_same(corr, metrics, V.rollout_corr_helper.compute_rollout_correction_and_rejection_mask(*args, **kw),
                    f"{case} seed {seed}")
        rejected += float(1 - corr.mask.sum() / b["response_mask"].sum())
    if kw["rollout_rs"]:
        assert 0 < rejected < 3, f"{case}: the thresholds should reject some tokens, not all"


def test_correction_ignores_masked_positions():
    b = V.batch(0)
    kw = {**OFF, **CASES["is-and-rs"]}
    junk_old = torch.where(b["response_mask"].bool(), b["old_log_probs"], torch.tensor(float("nan")))
    junk_roll = torch.where(b["response_mask"].bool(), b["rollout_log_probs"], torch.tensor(float("inf")))
    a, ma = compute_rollout_correction(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], **kw)
    c, mc = compute_rollout_correction(junk_old, junk_roll, b["response_mask"], **kw)
    assert torch.equal(a.weights, c.weights) and torch.equal(a.mask, c.mask) and ma == mc


@pytest.mark.parametrize("name", V.PRESETS)
def test_preset_equals_verl(name):
    """`preset=<name>` gives every field of verl's `RolloutCorrectionConfig.<name>()`, and the
    same weights and mask on a batch (decoupled presets; bypass ones in the loss test)."""
    verl_rc = V.preset(name)
    ours = correction_settings(load_config(None, [f"algorithm.rollout_correction.preset={name}"]))
    for f in V.CORRECTION_FIELDS:
        v, o = getattr(verl_rc, f), getattr(ours, f)
        assert (str(v) if "threshold" in f and v is not None else v) == o, (name, f, o, v)
    if not verl_rc.bypass_mode:
        b = V.batch(1, spread=0.05)
        args = (b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
        corr, metrics = compute_rollout_correction(*args, **V.correction_kwargs(ours))
        verl_out = V.rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
            *args, **V.correction_kwargs(verl_rc))
        assert_same(corr, metrics, verl_out, name)


def test_every_verl_preset_is_offered():
    assert sorted(ROLLOUT_CORRECTION_PRESETS) == sorted(V.PRESETS)
    with pytest.raises(ConfigError, match="verl 0.9.1 names it bypass_ppo_clip"):
        load_config(None, ["algorithm.rollout_correction.preset=ppo_is_bypass"])


BYPASS = {
    "ppo-clip": dict(loss_type="ppo_clip"),
    "ppo-clip-geo-rs": dict(loss_type="ppo_clip", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.9_1.1"),
    "ppo-clip-is-logged": dict(loss_type="ppo_clip", rollout_is="token", rollout_rs="token_k3",
                               rollout_rs_threshold=0.03),
    "pg-seq-is": dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0),
    "pg-token-icepop-k2": dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.8_1.25",
                               rollout_rs="seq_max_k2", rollout_rs_threshold=0.08),
    "pg-normalized-no-is": dict(loss_type="reinforce", rollout_rs="token_k1", rollout_rs_threshold="0.7_1.3"),
    "pg-normalized": dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=3.0,
                          rollout_is_batch_normalize=True),
}


@pytest.mark.parametrize("engine", [False, True], ids=["own-denominators", "engine-denominators"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("case", list(BYPASS))
def test_bypass_loss_equals_verl(case, agg, engine):
    """Bypass mode: correction against the *current* policy inside the loss (the rollout
    log-probs are the PPO anchor); loss, gradient and metrics equal verl's
    `compute_policy_loss_bypass_mode`, alone or with the denominators verl's engine hands it
    (tokens and responses counted before the loss rejects any)."""
    kw = {**OFF, **BYPASS[case]}
    b = V.batch(2)
    mask = b["response_mask"]
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    lp_ours = b["old_log_probs"].clone().requires_grad_(True)  # the current policy
    lp_verl = b["old_log_probs"].clone().requires_grad_(True)
    denominators = dict(batch_num_tokens=float(mask.sum()), global_batch_size=float(len(mask))) if engine else {}
    loss, m = bypass_policy_loss(lp_ours, b["rollout_log_probs"], adv, mask, 0.2, 0.2, 3.0, agg, **kw, **denominators)
    cfg = V.actor_config(loss_agg_mode=agg, rollout_correction=V.rollout_corr_config(bypass_mode=True, **kw))
    cfg.global_batch_info.update(denominators)
    v_loss, v_m = V.core_algos.compute_policy_loss_bypass_mode(b["rollout_log_probs"], lp_verl, adv, mask, agg,
                                                              config=cfg)
    # (verl's seq-mean-token-mean divides by token counts + 1e-8: equal to about 1e-8)
    assert float(loss.detach()) == pytest.approx(float(v_loss.detach()), rel=1e-7, abs=1e-12)
    loss.backward()
    v_loss.backward()
    valid = mask.bool()
    assert torch.allclose(lp_ours.grad[valid], lp_verl.grad[valid], rtol=1e-7, atol=1e-12)
    ours = {(k if "/" in k else f"actor/{k}"): float(v) for k, v in m.items()}
    wrong = {k: (ours.get(k), float(v)) for k, v in v_m.items() if not V.close(ours.get(k, float("nan")), float(v))}
    assert not wrong, wrong
    if kw["rollout_rs"]:  # rejection happens: against the current policy, not the rollout's log-probs themselves
        assert 0 < ours["rollout_corr/rollout_rs_masked_fraction"] < 1


@pytest.mark.parametrize("engine", [False, True], ids=["own-denominators", "engine-denominators"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_decoupled_weights_in_the_loss_equal_verl(agg, engine):
    """Decoupled mode: the IS weights multiply the clipped surrogate over the rejection mask,
    as verl's vanilla loss does with `rollout_is_weights` (verl's engine counts a response
    rejected whole in the sequence mean's denominator: its global_batch_size)."""
    b = V.batch(4)
    corr, _ = compute_rollout_correction(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"],
                                         **{**OFF, **CASES["is-and-rs"]})
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(corr.mask.shape, generator=g, dtype=torch.float64)
    lp = b["old_log_probs"] + 0.1 * torch.randn(corr.mask.shape, generator=g, dtype=torch.float64)
    assert (corr.mask.sum(-1) == 0).any()  # a response rejected whole
    denominators = dict(global_batch_size=float(len(corr.mask))) if engine else {}
    loss, m = policy_loss(lp, b["old_log_probs"], adv, corr.mask, 0.2, 0.2, 3.0, agg, rollout_is_weights=corr.weights,
                          **denominators)
    cfg = V.actor_config(loss_agg_mode=agg)
    cfg.global_batch_info.update(denominators)
    v_loss, v_m = V.core_algos.compute_policy_loss_vanilla(b["old_log_probs"], lp, adv, corr.mask, agg, config=cfg,
                                                           rollout_is_weights=corr.weights)
    assert float(loss) == pytest.approx(float(v_loss), rel=1e-9)
    for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        assert float(m[k]) == pytest.approx(v_m[f"actor/{k}"], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("kw", [
    dict(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0),  # no seq_max for k1
    dict(rollout_rs="geometric", rollout_rs_threshold=2.0),  # the older level names
    dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2"),  # k2/k3 take an upper bound only
    dict(rollout_rs="token_k1", rollout_rs_threshold="2_0.5"),  # lower > upper
    dict(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.5_2,0.1,0.2"),  # 3 thresholds, 2 criteria
    dict(rollout_rs="token_k1", rollout_rs_threshold=None),
    dict(rollout_is="token", rollout_is_threshold="2_0.5"),
    dict(rollout_is="token", rollout_is_threshold="abc"),
    dict(rollout_is="geometric"),
])
def test_bad_settings_raise_where_verl_raises(kw):
    b = V.batch(0)
    args = (b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    with pytest.raises(ValueError):
        V.rollout_corr_helper.compute_rollout_correction_and_rejection_mask(*args, **{**OFF, **kw})
    with pytest.raises(ValueError):
        compute_rollout_correction(*args, **{**OFF, **kw})
    overrides = [f"algorithm.rollout_correction.{k}={'null' if v is None else repr(v) if isinstance(v, str) else v}"
                 for k, v in kw.items()]
    with pytest.raises(ConfigError, match="algorithm.rollout_correction"):
        load_config(None, overrides)


def test_quoted_bounds_mean_what_verl_means():
    """rollout_is_threshold='0.5_2' is IcePop's bounds 0.5 and 2 (not the number 0.52); the
    unquoted form, which YAML and Hydra read as 0.52, is refused."""
    rc = correction_settings(load_config(None, ["algorithm.rollout_correction.rollout_is_threshold='0.5_2'"]))
    assert rc.rollout_is_threshold == "0.5_2"
    b = V.batch(6, spread=0.6)
    args = (b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    corr, metrics = compute_rollout_correction(*args, **V.correction_kwargs(rc))
    verl_out = V.rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
        *args, **{**OFF, "rollout_is": "token", "rollout_is_threshold": "0.5_2"})
    assert_same(corr, metrics, verl_out, "0.5_2")
    assert metrics["rollout_corr/rollout_is_oob_ratio"] > 0  # weights outside [0.5, 2] are zeroed
    with pytest.raises(ConfigError, match="reads as the number 0.52"):
        load_config(None, ["algorithm.rollout_correction.rollout_is_threshold=0.5_2"])
    rc = correction_settings(load_config(None, ["algorithm.rollout_correction.rollout_rs=token_k1,seq_mean_k3",
                                                "algorithm.rollout_correction.rollout_rs_threshold=0.5_2,0.01"]))
    assert (rc.rollout_rs, rc.rollout_rs_threshold) == ("token_k1,seq_mean_k3", "0.5_2,0.01")


def test_older_keys_are_refused_as_verl_refuses_them():
    for key in ("algorithm.rollout_is=true", "algorithm.rollout_is_level=geometric",
                "algorithm.rollout_correction.rollout_token_veto_threshold=1e-4",
                "algorithm.rollout_correction.rollout_rs_threshold_lower=0.5",
                "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",
                "actor_rollout_ref.rollout.calculate_log_probs=false"):
        with pytest.raises(ConfigError, match="verl"):
            load_config(None, [key])
    load_config(None, ["actor_rollout_ref.rollout.calculate_log_probs=true"])  # what it always is here
    off = correction_settings(load_config(None, ["algorithm.rollout_correction=null"]))  # verl: no correction
    assert off.rollout_is is None and off.rollout_rs is None and not off.bypass_mode


def test_correction_changes_nothing_when_log_probs_agree():
    b = V.batch(7)
    lp, mask = b["old_log_probs"], b["response_mask"]
    for kw in (CASES["is-token-tis"], CASES["is-and-rs"], CASES["rs-chained-per-criterion"]):
        corr, m = compute_rollout_correction(lp, lp.clone(), mask, **{**OFF, **kw})
        assert torch.equal(corr.mask, mask)
        assert corr.weights is None or torch.equal(corr.weights, mask)
        assert m["rollout_corr/kl"] == 0 and m["rollout_corr/chi2_token"] == 0


def test_tis_cap_is_the_token_preset():
    cap = correction_settings(load_config(None, ["actor.tis_imp_ratio_cap=1.5"]))
    token = dataclasses.replace(V.preset("decoupled_token_is"), rollout_is_threshold=1.5)
    assert V.correction_kwargs(cap) == {**V.correction_kwargs(token), "rollout_is_threshold": "1.5"}


def test_probs_diff_metrics_equal_verl():
    b = V.batch(8, spread=0.5)
    data = V.data_proto(b)
    data.batch["responses"] = torch.zeros_like(b["response_mask"], dtype=torch.long)
    ours = probs_diff_metrics(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    theirs = V.calculate_debug_metrics(data)
    assert set(ours) == set(theirs)
    assert all(V.close(ours[k], float(v)) for k, v in theirs.items()), (ours, theirs)
