"""Optuna study access for sweeps: open or continue a study in an RDB storage, ask and
tell in batches. A running trial reports its per-round values for pruning through
`rlhf.tracking.study.TrialReporter`, the engine's side of the study.

Storage: a SQLite file by default (one process at a time), a PostgreSQL URL
(`postgresql://user@host/db`) when trials run in parallel workers. Everything that
crosses a process boundary is a plain value (study name, storage URL, trial number),
so trials in other processes or pods reach the same study.

A worker that dies mid-trial (a killed pod, a lost node) cannot tell its trial FAIL. Its
`TrialReporter` records a heartbeat every `heartbeat_interval` seconds while the trial
runs; `ask_batch` first fails every RUNNING trial whose heartbeat is older than
`grace_period`, and Optuna's retry callback queues a retry with the same params
(up to `max_retry` times), which the next ask picks up. A reporter opened only around a
round's report beats once per round, so `grace_period` must exceed a round's duration.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from rlhf.tracking.study import StudySpec, TrialReporter, pruner_for  # noqa: F401 (part of the sweep API)
from sweeps.space import suggest

log = logging.getLogger(__name__)


def storage_url(spec: StudySpec, output_dir: str = "outputs") -> str:
    if spec.storage:
        return spec.storage
    path = Path(output_dir) / "sweeps" / "optuna.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path.resolve()}"


def _sampler(spec: StudySpec):
    import optuna

    if spec.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=max(2, spec.n_startup_trials),
                                          constant_liar=True)
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=spec.seed)
    if spec.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=spec.seed)
    raise ValueError(f"unknown sweep sampler {spec.sampler!r}; choose tpe, random or nsga2")


def _retry_stale_trials(max_retry: int) -> dict:
    """`RDBStorage`'s argument for the callback that re-queues a trial whose heartbeat went
    stale (with the same params): Optuna 4.9 renamed both the callback class and the argument
    (`RetryHeartbeatStaleTrialCallback`, `heartbeat_stale_trial_callback`) and deprecates the
    old names, which older 4.x releases alone have."""
    import optuna

    new = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    if new is not None:
        return {"heartbeat_stale_trial_callback": new(max_retry=max_retry)}
    return {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=max_retry)}


def open_study(spec: StudySpec, storage: str):
    """Create the study, or load it when a study of that name exists (a re-launch continues it).

    The sampler is seeded with `spec.seed` plus the study's trial count: a study opened anew for
    every batch (each ask runs in a fresh task) would otherwise draw the same points again."""
    import dataclasses

    import optuna

    rdb = optuna.storages.RDBStorage(storage, heartbeat_interval=spec.heartbeat_interval,
                                     grace_period=spec.grace_period, **_retry_stale_trials(spec.max_retry))
    study = optuna.create_study(study_name=spec.name, storage=rdb, directions=list(spec.directions),
                                sampler=_sampler(spec), pruner=pruner_for(spec), load_if_exists=True)
    n_trials = len(study.get_trials(deepcopy=False))
    if n_trials:
        study.sampler = _sampler(dataclasses.replace(spec, seed=spec.seed + n_trials))
    return study


def ask_batch(study, space, k: int) -> list[tuple[int, dict[str, Any]]]:
    """Ask `k` trials; returns (trial number, sampled params) for each. Trials whose worker
    stopped sending heartbeats are failed first, so their retries (same params) come first."""
    import optuna

    out = []
    with warnings.catch_warnings():
        # Heartbeats come from `TrialReporter`, not from `Study.optimize`, which optuna warns about.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
        for _ in range(k):
            trial = study.ask()
            out.append((trial.number, suggest(trial, space)))
    return out


def tell_batch(study, results: list[tuple[int, str, list[float]]]) -> None:
    """results: (trial number, state "COMPLETE"|"PRUNED"|"FAIL", values) per trial."""
    import optuna

    states = {"COMPLETE": optuna.trial.TrialState.COMPLETE, "PRUNED": optuna.trial.TrialState.PRUNED,
              "FAIL": optuna.trial.TrialState.FAIL}
    for number, state, values in results:
        st = states[state]
        current = study.trials[number].state if number < len(study.trials) else None
        if current is not None and current.is_finished():
            log.info("trial %d already finished as %s; not told again", number, current.name)
            continue
        study.tell(number, values if st == optuna.trial.TrialState.COMPLETE else None, state=st)
