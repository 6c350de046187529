"""Optuna study handling against the local PostgreSQL server (parallel workers) and SQLite."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import optuna
import pytest

from sweeps.space import default_space
from sweeps.study import StudySpec, TrialReporter, ask_batch, open_study, storage_url, tell_batch

PG_URL = os.environ.get("RLHF_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_available() -> bool:
    import sqlalchemy as sa

    try:
        with sa.create_engine(PG_URL).connect():
            return True
    except Exception:
        return False


def _score(params: dict) -> float:
    return -abs(params["actor.clip_ratio"] - 0.2) - params["actor.entropy_coeff"]


def _worker(storage: str, name: str, n: int) -> None:
    study = open_study(StudySpec(name=name, sampler="random", seed=os.getpid()), storage)
    for _ in range(n):
        ((number, params),) = ask_batch(study, default_space(), 1)
        tell_batch(study, [(number, "COMPLETE", [_score(params)])])


@pytest.fixture
def pg_storage():
    if not _pg_available():
        pytest.fail(f"PostgreSQL is not reachable at {PG_URL}; start it (see README) or set RLHF_TEST_POSTGRES_URL")
    return PG_URL


def test_two_workers_share_a_postgres_study(pg_storage):
    name = f"parallel-{uuid.uuid4().hex[:8]}"
    open_study(StudySpec(name=name), pg_storage)  # create once, so the workers only load it
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(pg_storage, name, 5)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    trials = optuna.load_study(study_name=name, storage=pg_storage).get_trials(deepcopy=False)
    assert len(trials) == 10, "a trial was lost or duplicated"
    assert sorted(t.number for t in trials) == list(range(10))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({t._trial_id for t in trials}) == 10


def test_relaunch_with_same_name_continues(tmp_path):
    storage = storage_url(StudySpec(), str(tmp_path))
    spec = StudySpec(name="resume", sampler="random")
    study = open_study(spec, storage)
    tell_batch(study, [(n, "COMPLETE", [_score(p)]) for n, p in ask_batch(study, default_space(), 3)])
    del study  # "interrupted"
    study = open_study(spec, storage)
    assert len(study.trials) == 3
    tell_batch(study, [(n, "COMPLETE", [_score(p)]) for n, p in ask_batch(study, default_space(), 2)])
    assert len(open_study(spec, storage).trials) == 5


def test_failed_trial_is_recorded_and_telling_twice_is_harmless(tmp_path):
    storage = storage_url(StudySpec(), str(tmp_path))
    study = open_study(StudySpec(name="fail"), storage)
    (a, _), (b, pb) = ask_batch(study, default_space(), 2)
    tell_batch(study, [(a, "FAIL", []), (b, "COMPLETE", [_score(pb)])])
    tell_batch(study, [(a, "FAIL", [])])
    states = [t.state for t in optuna.load_study(study_name="fail", storage=storage).trials]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE]


def test_reporter_prunes_a_bad_trial_before_its_last_round(tmp_path):
    storage = storage_url(StudySpec(), str(tmp_path))
    spec = StudySpec(name="prune", n_startup_trials=2, n_warmup_steps=1)
    study = open_study(spec, storage)
    for number, _ in ask_batch(study, default_space(), 2):  # two good finished trials
        rep = TrialReporter(storage, spec, number)
        for step in range(4):
            assert not rep.report(0.5 + 0.1 * step, step)
        tell_batch(study, [(number, "COMPLETE", [0.8])])
    ((bad, _),) = ask_batch(study, default_space(), 1)
    rep = TrialReporter(storage, spec, bad)
    pruned_at = next((s for s in range(4) if rep.report(0.0, s)), None)
    assert pruned_at is not None and pruned_at < 3


def test_pruning_check_reports_the_validations_inside_a_segment(tmp_path):
    """After a colocated segment, `check_pruning` reports each of its rounds' val scores at its
    round (not only the last), and a later segment adds only its own."""
    from rlhf.round.state import RoundState, Verdict
    from rlhf.tracking.trial import TrialContext, check_pruning

    spec = StudySpec(name="segments")
    storage = storage_url(spec, str(tmp_path))
    study = open_study(spec, storage)
    ((number, _),) = ask_batch(study, default_space(), 1)
    ctx = TrialContext(study=spec, storage=storage, number=number)
    vals = [{"round": float(r), "step": float(r), "score": 0.1 * r} for r in range(0, 6)]
    check_pruning(ctx, RoundState(round=3, val_history=vals[:4]), Verdict(stop=False), rounds_left=True)
    check_pruning(ctx, RoundState(round=5, val_history=vals), Verdict(stop=False), rounds_left=True)
    trial = optuna.load_study(study_name="segments", storage=storage).trials[0]
    assert trial.intermediate_values == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4, 5: 0.5})
