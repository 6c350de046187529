"""Optuna study access for sweeps: open or continue a study in an RDB storage, ask and
tell in batches, and let a running trial report per-round values for pruning.

Storage: a SQLite file by default (one process at a time), a PostgreSQL URL
(`postgresql://user@host/db`) when trials run in parallel workers. Everything that
crosses a process boundary is a plain value (study name, storage URL, trial number),
so trials in other processes or pods reach the same study.

A worker that dies mid-trial (a killed pod, a lost node) cannot tell its trial FAIL. Its
`TrialReporter` records a heartbeat every `heartbeat_interval` seconds while the trial
runs; `ask_batch` first fails every RUNNING trial whose heartbeat is older than
`grace_period`, and `RetryFailedTrialCallback` queues a retry with the same params
(up to `max_retry` times), which the next ask picks up. A reporter opened only around a
round's report beats once per round, so `grace_period` must exceed a round's duration.
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StudySpec:
    name: str = "ppo-sweep"
    storage: str = ""  # "" => sqlite:///outputs/sweeps/optuna.db
    directions: list[str] = field(default_factory=lambda: ["maximize"])  # ["maximize", "minimize"] => Pareto
    sampler: str = "tpe"  # "tpe" | "random" | "nsga2"
    pruner: str = "median"  # "median" | "sha" (successive halving) | "hyperband" | "none"
    seed: int = 0
    n_startup_trials: int = 2  # median pruner: trials before pruning starts
    n_warmup_steps: int = 1  # median pruner: rounds reported before a trial can be pruned
    min_resource: int = 1  # sha, hyperband: rounds every trial runs before its first rung
    reduction_factor: int = 2  # sha, hyperband: 1 in `reduction_factor` trials goes on at each rung
    max_resource: int = 0  # hyperband: a trial's most rounds (trainer.total_rounds); 0 => the longest trial told
    heartbeat_interval: int = 60  # seconds between a running trial's heartbeats
    grace_period: int = 1800  # a RUNNING trial without a heartbeat this long is failed; > a round's duration
    max_retry: int = 1  # retries of a trial failed that way (same params)


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


def _pruner(spec: StudySpec):
    import optuna

    if spec.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=spec.n_startup_trials, n_warmup_steps=spec.n_warmup_steps)
    if spec.pruner == "sha":
        # Rungs at min_resource x reduction_factor**i rounds; asynchronous, so it works with
        # trials told in batches: a trial goes on when it is in the top 1/reduction_factor
        # of the trials that reached the same rung so far.
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=spec.min_resource,
                                                      reduction_factor=spec.reduction_factor)
    if spec.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=spec.min_resource,
                                              max_resource=spec.max_resource or "auto",
                                              reduction_factor=spec.reduction_factor)
    if spec.pruner == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"unknown sweep pruner {spec.pruner!r}; choose median, sha, hyperband or none")


def open_study(spec: StudySpec, storage: str):
    """Create the study, or load it when a study of that name exists (a re-launch continues it).

    The sampler is seeded with `spec.seed` plus the study's trial count: a study opened anew for
    every batch (each ask runs in a fresh task) would otherwise draw the same points again."""
    import dataclasses

    import optuna

    retry = optuna.storages.RetryFailedTrialCallback(max_retry=spec.max_retry)
    rdb = optuna.storages.RDBStorage(storage, heartbeat_interval=spec.heartbeat_interval,
                                     grace_period=spec.grace_period, failed_trial_callback=retry)
    study = optuna.create_study(study_name=spec.name, storage=rdb, directions=list(spec.directions),
                                sampler=_sampler(spec), pruner=_pruner(spec), load_if_exists=True)
    n_trials = len(study.get_trials(deepcopy=False))
    if n_trials:
        study.sampler = _sampler(dataclasses.replace(spec, seed=spec.seed + n_trials))
    return study


def ask_batch(study, space, k: int) -> list[tuple[int, dict[str, Any]]]:
    """Ask `k` trials; returns (trial number, sampled params) for each. Trials whose worker
    stopped sending heartbeats are failed first, so their retries (same params) come first."""
    import optuna

    from sweeps.space import suggest

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


class TrialReporter:
    """Reports a running trial's per-round values to the study; `should_prune` asks the pruner.
    While it is open, a daemon thread records the trial's heartbeat every
    `spec.heartbeat_interval` seconds (use it as a context manager, or call `close()`).

    Built from plain values so a trial running in another process can use it."""

    def __init__(self, storage: str, spec: StudySpec, trial_number: int):
        import optuna

        # The pruner is not stored with the study: load it with the sweep's own.
        self.study = optuna.load_study(study_name=spec.name, storage=storage, pruner=_pruner(spec))
        self.trial_id = self.study._storage.get_trial_id_from_study_id_trial_number(self.study._study_id,
                                                                                   trial_number)
        self.trial = optuna.trial.Trial(self.study, self.trial_id)
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._beat_every, args=(spec.heartbeat_interval,), daemon=True,
                                        name=f"optuna-heartbeat-{trial_number}")
        self._thread.start()

    def _beat(self) -> None:
        self.study._storage.record_heartbeat(self.trial_id)

    def _beat_every(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self._beat()
            except Exception as e:  # a storage hiccup must not kill the trial; the next beat retries
                log.warning("heartbeat of trial %d not recorded: %s", self.trial.number, e)

    def report(self, value: float, step: int) -> bool:
        """Record `value` at `step`; True when the pruner says to stop this trial."""
        self.trial.report(value, step)
        return self.trial.should_prune()

    def reported_steps(self) -> set[int]:
        """The steps this trial has reported values at."""
        return set(self.study._storage.get_trial(self.trial_id).intermediate_values)

    def close(self) -> None:
        """Stop the heartbeat (before the trial is told its result)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "TrialReporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
