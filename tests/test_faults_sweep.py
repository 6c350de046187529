"""Sweep workers dying mid-trial on the local PostgreSQL: the trial is failed through its
stale heartbeat and retried with the same params, as many times as the retry policy allows.
(Concurrent workers never double-assigning a trial: tests/test_sweep_study.py::
test_two_workers_share_a_postgres_study.)"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from pathlib import Path

import optuna
import pytest

from sweeps.space import default_space
from sweeps.study import StudySpec, TrialReporter, ask_batch, open_study
PG_URL = os.environ.get("RLHF_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
HEARTBEAT_S, GRACE_S = 1, 2


@pytest.fixture
def pg_storage():
    import sqlalchemy as sa

    try:
        with sa.create_engine(PG_URL).connect():
            return PG_URL
    except Exception as e:
        pytest.fail(f"PostgreSQL is not reachable at {PG_URL} ({e}); start it or set RLHF_TEST_POSTGRES_URL")


def _run_trial(storage: str, spec: StudySpec, number: int, started: str) -> None:
    """A sweep worker: reports a first round for its trial, then trains "forever"."""
    with TrialReporter(storage, spec, number) as rep:
        rep.report(0.25, 0)
        Path(started).write_text("running")
        time.sleep(600)


def _start_and_kill(storage: str, spec: StudySpec, number: int, tmp: Path) -> None:
    started = tmp / f"started-{number}"
    proc = mp.get_context("spawn").Process(target=_run_trial, args=(storage, spec, number, str(started)))
    proc.start()
    deadline = time.monotonic() + 60
    while not started.exists():
        assert proc.is_alive() and time.monotonic() < deadline, f"worker for trial {number} did not start"
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no cleanup, no tell
    proc.join(10)
    assert proc.exitcode == -9


def _trial(storage: str, name: str, number: int) -> optuna.trial.FrozenTrial:
    return optuna.load_study(study_name=name, storage=storage).trials[number]


def test_worker_killed_mid_trial_is_failed_by_heartbeat_and_retried_once(pg_storage, tmp_path):
    name = f"killed-{uuid.uuid4().hex[:8]}"
    spec = StudySpec(name=name, sampler="random", heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                     max_retry=1)
    study = open_study(spec, pg_storage)
    ((first, params),) = ask_batch(study, default_space(), 1)
    _start_and_kill(pg_storage, spec, first, tmp_path)
    dead = _trial(pg_storage, name, first)
    assert dead.state == optuna.trial.TrialState.RUNNING and dead.intermediate_values == {0: 0.25}

    time.sleep(GRACE_S + 1)
    ((retry, retry_params),) = ask_batch(study, default_space(), 1)  # fails the stale trial first
    assert _trial(pg_storage, name, first).state == optuna.trial.TrialState.FAIL
    assert retry_params == params
    assert optuna.storages.RetryFailedTrialCallback.retried_trial_number(_trial(pg_storage, name, retry)) == first

    _start_and_kill(pg_storage, spec, retry, tmp_path)  # the retry's worker dies too
    time.sleep(GRACE_S + 1)
    ((fresh, _),) = ask_batch(study, default_space(), 1)
    assert _trial(pg_storage, name, retry).state == optuna.trial.TrialState.FAIL
    assert optuna.storages.RetryFailedTrialCallback.retried_trial_number(_trial(pg_storage, name, fresh)) is None, \
        "max_retry=1: a trial whose retry also died is not retried again"
    states = [t.state for t in optuna.load_study(study_name=name, storage=pg_storage).trials]
    assert states.count(optuna.trial.TrialState.RUNNING) == 1  # only the fresh trial, just asked


def test_live_worker_is_not_failed(pg_storage, tmp_path):
    """A trial whose worker keeps beating outlives the grace period and stays RUNNING."""
    name = f"alive-{uuid.uuid4().hex[:8]}"
    spec = StudySpec(name=name, sampler="random", heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    study = open_study(spec, pg_storage)
    ((number, _),) = ask_batch(study, default_space(), 1)
    with TrialReporter(pg_storage, spec, number):
        time.sleep(GRACE_S + 1.5)
        ask_batch(study, default_space(), 1)
        assert _trial(pg_storage, name, number).state == optuna.trial.TrialState.RUNNING
    assert len(study.trials) == 2
