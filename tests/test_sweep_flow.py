"""The sweep workflow executed locally (flytekit local execution, real PPO rounds on the tiny
model, SQLite study, MLflow server over HTTP): trial states, a trial that raises, the batch
order, a relaunch, nested MLflow runs, the best config file and the decks; pruning through
the pipeline's `decide` step."""

from __future__ import annotations

import logging

import optuna
import pytest

from rlhf.config import PPOConfig, load_config
from sweeps.confirm import ConfirmSpec
from sweeps.space import ParamSpec, apply, default_space
from sweeps.steps import DEFAULT_ATTR, SweepConfig
from sweeps.study import StudySpec, TrialReporter, ask_batch, open_study, storage_url, tell_batch
from test_trainer import TINY

COMPLETE, PRUNED, FAIL = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                          optuna.trial.TrialState.FAIL)
# A swept key pinned to one valid value, so that a trial queued with another value (3 does
# not divide train_batch_size 8) passes the sampler and then raises inside its pipeline.
MINI_BATCH = ParamSpec("actor.ppo_mini_batch_size", 8, 8, kind="int")
NO_CONFIRM = ConfirmSpec(k=0)  # these tests are about the search; test_sweep_confirm.py runs the confirm phase


@pytest.fixture(autouse=True)
def _no_flyte_cache(monkeypatch):
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")


def tiny_cfg(tmp_path, rounds: int, *extra: str) -> PPOConfig:
    # Segments of one round: the pruner sees every round's val score.
    return load_config(None, TINY + [f"trainer.total_rounds={rounds}", "trainer.val_before_train=false",
                                     "trainer.rounds_per_segment=1", f"trainer.output_dir={tmp_path}", *extra])


class DeckPaths(logging.Handler):
    """Collects the deck files flytekit writes in local runs."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.paths: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "flyte deck html to file://" in msg:
            self.paths.append(msg.split("file://", 1)[1].strip())


@pytest.fixture(scope="module")
def swept(tmp_path_factory, mlflow_server):
    """One sweep of 3 one-round trials, 2 at a time (the first queued trial cannot run), then a
    relaunch of the same study adding 1 trial."""
    from flytekit.loggers import logger

    from sweeps.sweep import ppo_sweep

    tmp = tmp_path_factory.mktemp("sweep")
    cfg = tiny_cfg(tmp, 1, "trainer.logger=[mlflow]", f"trainer.mlflow_tracking_uri={mlflow_server}")
    spec = StudySpec(name="e2e", sampler="random", seed=0)
    sweep = SweepConfig(study=spec, n_trials=3, batch_size=2, space=default_space() + [MINI_BATCH], confirm=NO_CONFIRM)
    storage = storage_url(spec, str(tmp))
    open_study(spec, storage).enqueue_trial({MINI_BATCH.name: 3})
    decks, level = DeckPaths(), logger.level
    logger.addHandler(decks)
    logger.setLevel(logging.INFO)
    try:
        first = ppo_sweep(cfg=cfg, sweep=sweep)
        trials_after_first = optuna.load_study(study_name="e2e", storage=storage).get_trials()
        second = ppo_sweep(cfg=cfg, sweep=SweepConfig(study=spec, n_trials=1, batch_size=2, space=sweep.space,
                                                      confirm=NO_CONFIRM))
    finally:
        logger.removeHandler(decks)
        logger.setLevel(level)
    study = optuna.load_study(study_name="e2e", storage=storage)
    return {"cfg": cfg, "first": first, "second": second, "after_first": trials_after_first, "study": study,
            "decks": decks.paths, "uri": mlflow_server}


@pytest.mark.slow
def test_sweep_records_every_trial_and_a_raising_trial_fails(swept):
    trials = swept["after_first"]
    assert [t.number for t in trials] == [0, 1, 2]
    bad, default, *rest = trials
    assert bad.params[MINI_BATCH.name] == 3 and bad.state == FAIL
    assert default.user_attrs[DEFAULT_ATTR] and default.state == COMPLETE
    assert default.params["actor.clip_ratio"] == PPOConfig().actor.clip_ratio
    # No pruning yet: the pruner waits for two complete trials, and only the default one was.
    assert [t.state for t in rest] == [COMPLETE]
    for t in [default, *rest]:
        assert t.user_attrs["steps"] == 1 and t.user_attrs["stop_reason"] == "total_rounds reached"
        assert list(t.intermediate_values) == [1]  # the round's val score, reported by `decide`
        assert t.values[0] == pytest.approx(t.user_attrs["final_val"] - 0.5 * t.user_attrs["kl_budget"])
    s = swept["first"].summary
    assert s.launched == 3 and s.states == {"FAIL": 1, "COMPLETE": 2}
    assert s.default_trial == 1 and s.best_trial in (1, 2)
    best = trials[s.best_trial]
    assert s.best_values == best.values and best.values[0] >= default.values[0]
    assert (s.best_val_score, s.default_val_score) == (best.user_attrs["final_val"], default.user_attrs["final_val"])


@pytest.mark.slow
def test_second_batch_is_asked_after_the_first_is_told(swept):
    first_batch, second_batch = swept["after_first"][:2], swept["after_first"][2:]
    told = max(t.datetime_complete for t in first_batch)
    assert all(t.datetime_start >= told for t in second_batch), (
        [(t.number, t.datetime_start, t.datetime_complete) for t in swept["after_first"]])


@pytest.mark.slow
def test_relaunch_with_the_same_name_continues_the_study(swept):
    trials = swept["study"].get_trials()
    assert len(trials) == 4 and [t.number for t in trials] == list(range(4))
    assert sum(bool(t.user_attrs.get(DEFAULT_ATTR)) for t in trials) == 1, "the default trial ran twice"
    assert trials[3].state == COMPLETE  # a last round is never pruned
    assert swept["second"].summary.n_trials == 4 and swept["second"].summary.launched == 1


@pytest.mark.slow
def test_best_config_file_loads_with_the_best_params(swept):
    from flytekit.interaction.click_types import JsonParamType

    s, study = swept["second"].summary, swept["study"]
    path = swept["second"].best_config.path
    assert path == s.best_config and path.endswith("sweeps/e2e/best_config.yaml")
    best = study.best_trial
    assert s.best_trial == best.number
    loaded = load_config(path)
    assert loaded == apply(swept["cfg"], best.params)
    assert loaded.actor.clip_ratio == best.params["actor.clip_ratio"]
    assert loaded.algorithm.kl_ctrl.kl_coef == best.params["algorithm.kl_ctrl.kl_coef"]
    # What `pyflyte run workflows/ppo.py ppo_pipeline --cfg FILE` builds from the file.
    assert JsonParamType(PPOConfig).convert(path, None, None) == loaded


@pytest.mark.slow
def test_one_parent_run_per_launch_and_a_nested_run_per_trial(swept):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(swept["uri"])
    exp = client.get_experiment_by_name(swept["cfg"].trainer.project_name)
    runs = client.search_runs([exp.experiment_id], "tags.`sweep.study` = 'e2e'", max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)
    first_parent = min(parents, key=lambda r: r.info.start_time)
    nested = {int(r.data.tags["sweep.trial"]): r for r in runs
              if r.data.tags.get("mlflow.parentRunId") == first_parent.info.run_id}
    assert sorted(nested) == [0, 1, 2]
    assert nested[0].info.status == "FAILED" and nested[0].data.tags["sweep.state"] == "FAIL"
    for number in (1, 2):
        run, trial = nested[number], swept["study"].trials[number]
        assert run.info.status == "FINISHED" and run.data.tags["sweep.state"] == "COMPLETE"
        assert float(run.data.params["actor.clip_ratio"]) == trial.params["actor.clip_ratio"]
        assert run.data.metrics["sweep/objective_0"] == pytest.approx(trial.values[0])
        assert "actor/pg_loss" in run.data.metrics and "val/accuracy" in run.data.metrics
    assert first_parent.data.metrics["sweep/n_trials"] == 3
    assert "sweep/best_config.yaml" in [a.path for a in client.list_artifacts(first_parent.info.run_id, "sweep")]


@pytest.mark.slow
def test_decks_show_the_optuna_plots(swept):
    sweep_decks = [p for p in swept["decks"] if "optimization history" in open(p, encoding="utf-8").read()]
    assert len(sweep_decks) == 2, swept["decks"]
    html = open(sweep_decks[-1], encoding="utf-8").read()
    assert "parallel coordinates" in html and "Optimization History Plot" in html
    assert html.count("Plotly.newPlot") >= 2 and "plotly.js v" in html  # library inlined: works offline
    # Importances only once complete trials differ in value (the tiny model often scores 0 everywhere).
    complete = [t for t in swept["study"].trials if t.state == COMPLETE]
    assert ("Hyperparameter Importances" in html) == (len({t.values[0] for t in complete}) > 1)


@pytest.mark.slow
def test_a_trial_with_bad_values_is_pruned_by_decide_before_its_last_round(tmp_path):
    """Two finished trials reported 0.9 after each round; the sweep's next trial (the tiny
    model, val score near 0) is stopped by its `decide` step after round 1 of 2."""
    from sweeps.sweep import ppo_sweep

    spec = StudySpec(name="prune", n_startup_trials=2, n_warmup_steps=1)
    storage = storage_url(spec, str(tmp_path))
    study = open_study(spec, storage)
    for number, _ in ask_batch(study, default_space(), 2):
        with TrialReporter(storage, spec, number) as rep:
            for step in (1, 2):
                assert not rep.report(0.9, step)
        tell_batch(study, [(number, "COMPLETE", [0.9])])
    out = ppo_sweep(cfg=tiny_cfg(tmp_path, 2), sweep=SweepConfig(study=spec, n_trials=1, batch_size=1,
                                                                 confirm=NO_CONFIRM))
    trial = optuna.load_study(study_name="prune", storage=storage).trials[2]
    assert trial.state == PRUNED, (trial.state, trial.user_attrs)
    assert list(trial.intermediate_values) == [1] and trial.intermediate_values[1] < 0.9
    assert trial.user_attrs["stop_reason"].startswith("pruned") and trial.user_attrs["steps"] == 1
    assert out.summary.states == {"COMPLETE": 2, "PRUNED": 1}


def test_a_study_reopened_for_every_batch_draws_new_points(tmp_path):
    """Each batch opens the study anew (a fresh task): the sampler must not restart its draws."""
    spec = StudySpec(name="reopen", seed=0, n_startup_trials=4)
    storage, drawn = storage_url(spec, str(tmp_path)), []
    for _ in range(3):
        study = open_study(spec, storage)
        batch = ask_batch(study, default_space(), 2)
        tell_batch(study, [(n, "COMPLETE", [p["actor.clip_ratio"]]) for n, p in batch])
        drawn += [p["actor.clip_ratio"] for _, p in batch]
    assert len(set(drawn)) == 6, drawn


def test_plots_need_two_varied_complete_trials_and_show_the_pareto_front():
    from sweeps.report import figures

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    assert figures(study) == {}
    study.add_trial(optuna.trial.create_trial(params={"x": 0.5}, distributions={
        "x": optuna.distributions.FloatDistribution(0, 1)}, value=1.0))
    assert set(figures(study)) == {"optimization history", "parallel coordinates"}
    study.optimize(lambda t: t.suggest_float("x", 0, 1) ** 2, n_trials=4)
    assert "parameter importances" in figures(study)
    pareto = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    pareto.optimize(lambda t: (t.suggest_float("x", 0, 1), t.suggest_float("y", 0, 1)), n_trials=6)
    figs = figures(pareto)
    assert set(figs) == {"optimization history", "parallel coordinates", "parameter importances", "pareto front"}
    assert "Pareto-front" in figs["pareto front"].layout.title.text
