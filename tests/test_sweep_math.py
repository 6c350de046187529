import optuna
import pytest

from rlhf.config import PPOConfig
from sweeps.objective import (TrialMetrics, convergence_metrics, objective, pareto_front, pareto_objectives,
                              val_curve)
from sweeps.space import ParamSpec, apply, check_space, default_space, suggest, to_overrides


def test_default_space_bounds_and_application():
    space = default_space()
    check_space(space)
    names = {p.name: p for p in space}
    assert names["algorithm.kl_ctrl.kl_coef"].log and names["algorithm.kl_ctrl.kl_coef"].low == 1e-4
    assert (names["actor.clip_ratio"].low, names["actor.clip_ratio"].high) == (0.1, 0.3)
    assert (names["actor.entropy_coeff"].low, names["actor.entropy_coeff"].high) == (0.0, 0.01)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        params = suggest(study.ask(), space)
        assert 1e-4 <= params["algorithm.kl_ctrl.kl_coef"] <= 1e-1
        cfg = apply(PPOConfig(), params)
        assert cfg.actor.clip_ratio == params["actor.clip_ratio"]  # exact: repr round-trips floats
        assert cfg.algorithm.kl_ctrl.kl_coef == params["algorithm.kl_ctrl.kl_coef"]
    assert PPOConfig().actor.clip_ratio == 0.2


def test_extra_keys_and_bad_specs():
    space = default_space() + [ParamSpec("rollout.n", 2, 8, kind="int"),
                               ParamSpec("algorithm.adv_estimator", kind="categorical", choices=["gae", "grpo"])]
    check_space(space)
    params = suggest(optuna.create_study().ask(), space)
    cfg = apply(PPOConfig(), params)
    assert cfg.rollout.n == params["rollout.n"] and cfg.algorithm.adv_estimator in ("gae", "grpo")
    assert to_overrides({"b": 1, "a": 0.1}) == ["a=0.1", "b=1"]
    for bad, match in [(ParamSpec("actor.clip_rat"), "not a config key"),
                       (ParamSpec("actor.clip_ratio", 0.3, 0.1), "low"),
                       (ParamSpec("actor.clip_ratio", 0.0, 0.1, log=True), "log range"),
                       (ParamSpec("algorithm.adv_estimator", kind="categorical"), "no choices")]:
        with pytest.raises(ValueError, match=match):
            check_space([bad])


def _hist(kls):
    return [{"actor/current_kl": k, "step": float(i + 1)} for i, k in enumerate(kls)]


def test_convergence_metrics_by_hand():
    vals = [{"round": 0.0, "step": 0.0, "score": 0.3}, {"round": 1.0, "step": 2.0, "score": 0.5},
            {"round": 2.0, "step": 4.0, "score": 0.45}]
    m = convergence_metrics(_hist([0.0, 0.05, 0.2, 0.3]), vals, "", target_kl=0.1, score_threshold=0.5)
    assert (m.best_val, m.final_val, m.start_val) == (0.5, 0.45, 0.3)
    assert m.kl_budget == 0.5 and m.mean_kl == pytest.approx(0.1375)
    assert m.steps_to_score == 2 and not m.diverged and m.steps == 4
    assert objective(m, kl_budget_weight=0.5, divergence_penalty=0.25) == pytest.approx(0.45 - 0.25)
    d = convergence_metrics(_hist([0.3]), vals, "KL 0.3000 above the ceiling early_stop.kl_ceiling=0.2", 0.1, 0.9)
    assert d.diverged and d.steps_to_score == -1
    assert objective(d, 0.0, 0.25) == pytest.approx(0.45 - 0.25)
    plateau = convergence_metrics(_hist([0.0]), vals, "validation score did not improve for 3 evaluations", 0.1, 1)
    assert not plateau.diverged


def test_pareto_front():
    pts = [(0.5, 0.1), (0.6, 0.2), (0.4, 0.05), (0.5, 0.3), (0.6, 0.1)]
    assert pareto_front(pts) == [2, 4]
    m = TrialMetrics(0.7, 0.6, 0.3, 0.0, 0.02, 3, "", False, 5)
    assert pareto_objectives(m) == (0.6, 0.02)


def test_area_under_the_val_curve_and_rounds_to_target_by_hand():
    # Round 3 has no val score (it keeps round 2's); rounds 5 runs after the last score (keeps 0.6).
    vals = [{"round": 1.0, "step": 2.0, "score": 0.2}, {"round": 2.0, "step": 4.0, "score": 0.4},
            {"round": 4.0, "step": 8.0, "score": 0.6}]
    assert val_curve(vals, 5) == [0.2, 0.4, 0.4, 0.6, 0.6]
    m = convergence_metrics(_hist([0.0, 0.2]), vals, "", target_kl=0.1, score_threshold=0.4, max_rounds=5)
    assert m.auc_val == pytest.approx(2.2 / 5) and m.rounds_to_score == 2 and m.steps_to_score == 4
    assert (m.last_val_round, m.max_rounds, m.kl_budget) == (4, 5, 0.5)
    assert objective(m, 0.5, 0.25, "final_val") == pytest.approx(0.6 - 0.25)
    assert objective(m, 0.5, 0.25, "auc") == pytest.approx(0.44 - 0.25)
    assert objective(m, 0.0, 0.25, "rounds_to_target") == pytest.approx((5 - 2 + 1) / 5)
    # Round 0 (val before training) fills the rounds before the first score; never reaching the
    # target scores 0 before the penalties, a divergence stop costs its penalty on every objective.
    early = [{"round": 0.0, "step": 0.0, "score": 0.1}, {"round": 2.0, "step": 4.0, "score": 0.3}]
    n = convergence_metrics(_hist([0.3]), early, "KL 0.3 above the ceiling", 0.1, 0.9, max_rounds=2)
    assert n.auc_val == pytest.approx((0.1 + 0.3) / 2) and n.rounds_to_score == -1
    assert objective(n, 0.0, 0.25, "rounds_to_target") == pytest.approx(-0.25)
    assert objective(n, 0.0, 0.25, "auc") == pytest.approx(0.2 - 0.25)
    # Without max_rounds the curve spans the rounds measured.
    assert convergence_metrics([], vals, "", 0.1, 0.5).auc_val == pytest.approx((0.2 + 0.4 + 0.4 + 0.6) / 4)
    with pytest.raises(ValueError, match="unknown sweep objective 'auc_val'.*rounds_to_target"):
        objective(m, name="auc_val")


def test_a_round_zero_score_alone_does_not_reach_the_target():
    vals = [{"round": 0.0, "step": 0.0, "score": 0.9}, {"round": 1.0, "step": 2.0, "score": 0.2}]
    m = convergence_metrics([], vals, "", 0.1, 0.5, max_rounds=3)
    assert m.rounds_to_score == -1 and objective(m, name="rounds_to_target") == 0.0
