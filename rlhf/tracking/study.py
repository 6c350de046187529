"""A sweep trial as the engine sees it: the study's definition (`StudySpec`), the pruner
it names, and `TrialReporter`, which reports a running trial's per-round values to the
study and keeps its heartbeat. Everything is built from plain values (study name, storage
URL, trial number), so a trial running in another process or pod reaches the same study.

Optuna loads inside the functions that use it. Its storage is reached through
`_storage` alone (see there why).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

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


def pruner_for(spec: StudySpec):
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


def _storage(study):
    """The study's storage. Optuna keeps it in the private `Study._storage` (and the study's
    id, which `trial_id` passes to it, in `Study._study_id`): the public API
    reads a trial of a loaded study only by copying every trial (`Study.trials`), and has no
    way to set a user attribute of a trial that is not the one being asked or to record a
    heartbeat outside `Study.optimize`. This module is the one place both are touched."""
    return study._storage


def trial_id(study, number: int) -> int:
    """The storage's id of trial `number` of `study`."""
    return _storage(study).get_trial_id_from_study_id_trial_number(study._study_id, number)


def stored_trial(study, number: int):
    """Trial `number` as stored (an `optuna.trial.FrozenTrial`), without copying the others."""
    return _storage(study).get_trial(trial_id(study, number))


def set_trial_attr(study, number: int, key: str, value) -> None:
    """Set user attribute `key` of trial `number` (a finished or a running trial)."""
    _storage(study).set_trial_user_attr(trial_id(study, number), key, value)


class TrialReporter:
    """Reports a running trial's per-round values to the study; `should_prune` asks the pruner.
    While it is open, a daemon thread records the trial's heartbeat every
    `spec.heartbeat_interval` seconds (use it as a context manager, or call `close()`).

    Built from plain values so a trial running in another process can use it."""

    def __init__(self, storage: str, spec: StudySpec, trial_number: int):
        import optuna

        # The pruner is not stored with the study: load it with the sweep's own.
        self.study = optuna.load_study(study_name=spec.name, storage=storage, pruner=pruner_for(spec))
        self.trial_id = trial_id(self.study, trial_number)
        self.trial = optuna.trial.Trial(self.study, self.trial_id)
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._beat_every, args=(spec.heartbeat_interval,), daemon=True,
                                        name=f"optuna-heartbeat-{trial_number}")
        self._thread.start()

    def _beat(self) -> None:
        _storage(self.study).record_heartbeat(self.trial_id)

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
        return set(_storage(self.study).get_trial(self.trial_id).intermediate_values)

    def close(self) -> None:
        """Stop the heartbeat (before the trial is told its result)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "TrialReporter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
