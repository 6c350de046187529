"""The confirm phase: mean and standard error per config, the decision against the default
config (hand-computed cases), the re-runs it plans, and one local Flyte sweep with a round
budget and a confirm phase (real PPO rounds on the tiny model, SQLite study, MLflow)."""

from __future__ import annotations

import dataclasses
import logging
import math

import optuna
import pytest

from rlhf.config import PPOConfig, load_config
from rlhf.round.state import RoundState
from sweeps.confirm import ConfirmRow, ConfirmSpec, Confirmed, decide, make_row, mean_se
from sweeps.space import apply, default_space
from sweeps.steps import DEFAULT_ATTR, SweepConfig, confirm_rows, plan_confirm
from sweeps.study import StudySpec

SE3 = 0.02 / math.sqrt(3)  # standard error of three scores 0.02 apart around their mean


def row(label: str, trial: int, scores: list[float]) -> ConfirmRow:
    return make_row(label, trial, {}, [(1000 + i, (s, s, [s])) for i, s in enumerate(scores)])


def test_mean_and_standard_error_by_hand():
    assert mean_se([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, math.sqrt(5 / 3) / 2))
    assert mean_se([0.5, 0.52, 0.48]) == pytest.approx((0.5, SE3))
    assert mean_se([0.7]) == (0.7, 0.0) and mean_se([]) == (0.0, 0.0)


def test_a_trial_more_than_two_standard_errors_above_the_default_wins():
    default = row("default", -1, [0.50, 0.52, 0.48])  # 0.50 +- 0.0115
    a = row("trial 3", 3, [0.60, 0.62, 0.58])  # 0.60 +- 0.0115: +0.10 > 2 x 0.0163
    b = row("trial 5", 5, [0.52, 0.54, 0.50])  # 0.52: +0.02 < 0.0327
    winner, why = decide([default, b, a])
    assert winner is a and why.startswith("trial 3 beats the default config by more than 2 standard errors")
    assert "+0.1000 vs 2 x SE 0.0163" in why and "+0.0200 vs 2 x SE 0.0163" in why


def test_no_trial_two_standard_errors_above_the_default_keeps_the_default():
    default = row("default", -1, [0.50, 0.52, 0.48])
    b = row("trial 5", 5, [0.52, 0.54, 0.50])
    winner, why = decide([default, b])
    assert winner is None and "no trial beats the default config by more than 2 standard errors" in why
    tie = row("trial 1", 1, [0.50, 0.52, 0.48])
    assert decide([default, tie])[0] is None  # a tie keeps the default
    same = [row("default", -1, [0.0, 0.0]), row("trial 1", 1, [0.0, 0.0])]
    assert decide(same)[0] is None  # SE 0 and no difference: still the default
    assert decide([row("default", -1, [0.0, 0.0]), row("trial 1", 1, [0.1, 0.1])])[0].trial == 1
    # A higher z asks for more: +0.02 over SE 0.0163 passes at z=1, not at z=2.
    assert decide([default, b], z=1.0)[0] is b


def test_the_highest_mean_that_passes_wins_not_the_highest_mean():
    default = row("default", -1, [0.50, 0.52, 0.48])
    noisy = row("trial 2", 2, [0.9, 0.3, 0.9])  # 0.70 +- 0.20: +0.20 < 2 x 0.2003
    steady = row("trial 4", 4, [0.60, 0.62, 0.58])
    winner, why = decide([default, noisy, steady])
    assert winner is steady and "trial 2: 0.7000 - 0.5000 = +0.2000 vs 2 x SE 0.2003" in why


def test_too_few_finished_seeds_cannot_win():
    default = row("default", -1, [0.50, 0.52, 0.48])
    one = make_row("trial 1", 1, {}, [(1, (0.9, 0.9, [0.9])), (2, None)])  # one seed failed
    assert (one.n, one.failed_seeds, one.se) == (1, [2], 0.0)
    winner, why = decide([default, one])
    assert winner is None and "trial 1 finished 1 confirm runs (< 2)" in why
    winner, why = decide([make_row("default", -1, {}, [(1, None), (2, None)]), row("trial 1", 1, [0.9, 0.8])])
    assert winner is None and "default config finished 0 confirm runs" in why
    assert decide([default])[1].startswith("no complete trial to confirm")


def _study_with_trials():
    study = optuna.create_study(direction="maximize")
    dists = {p.name: optuna.distributions.FloatDistribution(p.low, p.high, log=p.log) for p in default_space()}
    base = PPOConfig()
    default = {"algorithm.kl_ctrl.kl_coef": base.algorithm.kl_ctrl.kl_coef, "actor.clip_ratio": 0.2,
               "actor.entropy_coeff": 0.0}
    for value, clip, attrs in [(0.9, 0.2, {DEFAULT_ATTR: True}), (0.5, 0.11, {}), (0.7, 0.12, {}), (0.6, 0.13, {})]:
        params = {**default, "actor.clip_ratio": clip}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value, user_attrs=attrs))
    study.add_trial(optuna.trial.create_trial(params={**default, "actor.clip_ratio": 0.29}, distributions=dists,
                                              state=optuna.trial.TrialState.PRUNED, intermediate_values={1: 0.95}))
    return study


def test_confirm_plans_the_default_and_the_top_trials_on_every_fresh_seed():
    study, base = _study_with_trials(), load_config(None, ["trainer.total_rounds=6"])
    sweep = SweepConfig(confirm=ConfirmSpec(k=2, seeds=[11, 12], rounds=3))
    runs, cfgs = plan_confirm(study, base, sweep)
    # The default's own trial (0.9) and the pruned one are not candidates; trials 2 then 3 are.
    assert [(r.label, r.trial, r.seed) for r in runs] == [("default", -1, 11), ("default", -1, 12),
                                                          ("trial 2", 2, 11), ("trial 2", 2, 12),
                                                          ("trial 3", 3, 11), ("trial 3", 3, 12)]
    assert [c.trainer.seed for c in cfgs] == [11, 12] * 3 and {c.trainer.total_rounds for c in cfgs} == {3}
    assert cfgs[0] == dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, seed=11, total_rounds=3))
    assert cfgs[2].actor.clip_ratio == 0.12 and runs[2].params["actor.clip_ratio"] == "0.12"
    assert plan_confirm(study, base, SweepConfig(confirm=ConfirmSpec(k=0))) == ([], [])


def _state(scores: list[float], kls: list[float]) -> RoundState:
    return RoundState(round=len(scores), step_history=[{"actor/current_kl": k} for k in kls],
                      val_history=[{"round": float(i + 1), "step": float(i + 1), "score": s}
                                   for i, s in enumerate(scores)])


def test_confirm_rows_score_each_seed_with_the_sweeps_objective():
    study, base = _study_with_trials(), load_config(None, ["algorithm.kl_ctrl.target_kl=0.1"])
    sweep = SweepConfig(objective="auc", confirm=ConfirmSpec(k=1, seeds=[11, 12], rounds=2))
    runs, cfgs = plan_confirm(study, base, sweep)
    states = [_state([0.2, 0.4], [0.0, 0.0]), _state([0.3, 0.5], [0.2, 0.0]),  # default: KL over on 1 of 2 steps
              _state([0.6, 0.6], [0.0, 0.0]), None]  # trial 2, its second seed raised
    default, trial = confirm_rows(runs, cfgs, states, sweep)
    assert (default.label, default.seeds, default.n) == ("default", [11, 12], 2)
    assert default.scores == pytest.approx([0.3, 0.4 - 0.5 * 0.5]) and default.final_vals == [0.4, 0.5]
    assert default.curves == [[0.2, 0.4], [0.3, 0.5]]
    assert default.mean == pytest.approx(0.225) and default.se == pytest.approx(0.075)
    assert (trial.label, trial.scores, trial.failed_seeds, trial.n) == ("trial 2", [0.6], [12], 1)


def test_chosen_config_and_the_confirm_table():
    from sweeps.report import chosen_config, confirm_figure, confirm_metrics, confirm_table_html

    study, base = _study_with_trials(), PPOConfig()
    rows = [row("default", -1, [0.5, 0.52, 0.48]), row("trial 2", 2, [0.6, 0.62, 0.58])]
    won = Confirmed(objective="auc", rows=rows, winner="trial 2", winner_trial=2, reason="r")
    cfg, chosen, why = chosen_config(study, base, won)
    assert cfg == apply(base, study.trials[2].params) and (chosen, why) == ("trial 2", "r")
    kept = dataclasses.replace(won, winner="default", winner_trial=-1)
    assert chosen_config(study, base, kept)[:2] == (base, "default")
    cfg, chosen, _ = chosen_config(study, base, Confirmed(reason="no confirm phase"))
    assert chosen == "best trial 0" and cfg == apply(base, study.trials[0].params)
    html = confirm_table_html(won)
    assert "trial 2 <b>(chosen)</b>" in html and "<td>0.6000</td><td>0.0115</td><td>3</td>" in html
    assert confirm_metrics(won)["sweep/confirm/trial_2/mean"] == pytest.approx(0.6)
    fig = confirm_figure(won)
    assert [t.name for t in fig.data] == [f"{label} seed {s}" for label in ("default", "trial 2")
                                          for s in (1000, 1001, 1002)]


# ---------------------------------------------------------------------------------
# One local Flyte sweep: round budget, then the confirm phase
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def confirmed(tmp_path_factory, mlflow_server):
    """3 one-round trials (a budget of 3 rounds, 2 at a time: 2 trials, then 1), then the default
    config and the top trial on 2 fresh seeds of 1 round each."""
    from flytekit.loggers import logger

    from sweeps.sweep import ppo_sweep
    from test_sweep_flow import DeckPaths, tiny_cfg

    tmp = tmp_path_factory.mktemp("confirm")
    cfg = tiny_cfg(tmp, 1, "trainer.logger=[mlflow]", f"trainer.mlflow_tracking_uri={mlflow_server}")
    sweep = SweepConfig(study=StudySpec(name="confirm", sampler="random", pruner="sha", min_resource=1),
                        n_trials=10, batch_size=2, round_budget=3, objective="auc",
                        confirm=ConfirmSpec(k=1, seeds=[11, 12], rounds=1))
    decks, level = DeckPaths(), logger.level
    logger.addHandler(decks)
    logger.setLevel(logging.INFO)
    try:
        out = ppo_sweep(cfg=cfg, sweep=sweep)
    finally:
        logger.removeHandler(decks)
        logger.setLevel(level)
    from sweeps.study import storage_url

    study = optuna.load_study(study_name="confirm", storage=storage_url(sweep.study, str(tmp)))
    return {"out": out, "cfg": cfg, "study": study, "decks": decks.paths, "uri": mlflow_server, "tmp": tmp}


@pytest.mark.slow
def test_the_budget_stops_asking_and_the_summary_names_the_objective(confirmed):
    s, trials = confirmed["out"].summary, confirmed["study"].trials
    assert len(trials) == 3 and s.launched == 3, "a budget of 3 one-round trials asks 3 of the 10 trials"
    assert s.rounds_spent == 3 and s.round_budget == 3 and s.objective == "auc"
    assert all(t.user_attrs["rounds_run"] == 1 for t in trials)


@pytest.mark.slow
def test_the_confirm_table_and_the_chosen_config(confirmed):
    import json

    s, study = confirmed["out"].summary, confirmed["study"]
    complete = [t for t in study.trials if t.state.name == "COMPLETE" and not t.user_attrs.get(DEFAULT_ATTR)]
    top = max(complete, key=lambda t: (t.values[0], -t.number))
    assert [(r.label, r.trial) for r in s.confirm] == [("default", -1), (f"trial {top.number}", top.number)]
    for r in s.confirm:
        assert r.seeds == [11, 12] and r.n == 2 and [len(c) for c in r.curves] == [1, 1]
        assert (r.mean, r.se) == pytest.approx(mean_se(r.scores))
        # One round's area is that round's val score; the KL and divergence penalties only subtract.
        assert all(score <= curve[0] + 1e-9 for score, curve in zip(r.scores, r.curves)), (r.scores, r.curves)
    winner, why = decide(s.confirm)
    assert s.chosen_reason == why
    best = load_config(confirmed["out"].best_config.path)
    if winner is None:
        assert s.chosen == "default" and best == confirmed["cfg"]
    else:
        assert s.chosen == winner.label and best == apply(confirmed["cfg"], study.trials[winner.trial].params)
    data = json.loads(open(confirmed["tmp"] / "sweeps" / "confirm" / "summary.json").read())
    assert data["objective"] == "auc" and data["chosen"] == s.chosen and data["confirm"]["reason"] == why
    assert [r["label"] for r in data["confirm"]["rows"]] == [r.label for r in s.confirm]


@pytest.mark.slow
def test_confirm_deck_and_mlflow_runs(confirmed):
    from mlflow.tracking import MlflowClient

    pages = [open(p, encoding="utf-8").read() for p in confirmed["decks"]]
    page = next(p for p in pages if "Confirm phase: objective auc" in p)
    assert "Confirm runs: val score per round" in page and "default seed 11" in page
    client = MlflowClient(confirmed["uri"])
    exp = client.get_experiment_by_name(confirmed["cfg"].trainer.project_name)
    runs = client.search_runs([exp.experiment_id], "tags.`sweep.study` = 'confirm'", max_results=100)
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    reruns = [r for r in runs if "sweep.confirm" in r.data.tags]
    assert sorted((r.data.tags["sweep.confirm"], r.data.tags["sweep.confirm_seed"]) for r in reruns) == sorted(
        (r.label, str(seed)) for r in confirmed["out"].summary.confirm for seed in r.seeds)
    assert all(r.info.status == "FINISHED" and "val/accuracy" in r.data.metrics for r in reruns)
    assert parent.data.metrics["sweep/confirm/default/n"] == 2 and parent.data.tags["sweep.chosen"]
    arts = [a.path for a in client.list_artifacts(parent.info.run_id, "sweep")]
    assert "sweep/confirm_curves.html" in arts and "sweep/summary.json" in arts
