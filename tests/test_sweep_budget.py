"""Multi-fidelity sweeps: the round budget's accounting, and the successive-halving and
Hyperband pruners wired through the study (what a trial's `decide` step asks)."""

from __future__ import annotations

from types import SimpleNamespace

import optuna
import pytest

from rlhf.config import ConfigError, load_config
from sweeps.budget import ROUNDS_ATTR, next_batch_size, rounds_spent, trial_rounds
from sweeps.confirm import ConfirmSpec
from sweeps.space import default_space
from sweeps.steps import SweepConfig, check_sweep_for
from sweeps.study import StudySpec, TrialReporter, ask_batch, open_study, storage_url, tell_batch


def test_next_batch_asks_only_what_the_budget_can_run_to_the_end():
    assert next_batch_size(2, 10, 0, 500, 4) == 2  # no budget: batch size and trials left decide
    assert next_batch_size(2, 1, 0, 0, 4) == 1
    assert next_batch_size(2, 10, 12, 0, 4) == 2
    assert next_batch_size(2, 10, 12, 5, 4) == 1  # 7 rounds left: one trial of 4
    assert next_batch_size(2, 10, 12, 9, 4) == 0  # 3 left: a trial of 4 would go over
    assert next_batch_size(2, 10, 12, 13, 4) == 0
    assert next_batch_size(3, 10, 12, 0, 4) == 3 and next_batch_size(4, 10, 12, 0, 4) == 3
    with pytest.raises(ValueError, match="total_rounds"):
        next_batch_size(2, 10, 12, 0, 0)


def test_rounds_spent_counts_this_launch_and_prefers_the_told_count():
    def t(number, attrs, reported):
        return SimpleNamespace(number=number, user_attrs=attrs, intermediate_values={s: 0.0 for s in reported})

    trials = [t(0, {ROUNDS_ATTR: 4}, [1, 2, 3, 4]),  # an earlier launch's trial
              t(1, {ROUNDS_ATTR: 2}, [1, 2]),  # pruned after round 2
              t(2, {}, [1]),  # raised after reporting round 1: counts the round it reported
              t(3, {ROUNDS_ATTR: 4}, [2, 4]),  # test_freq=2: reports every other round, ran 4
              t(4, {}, [])]  # refused before it ran
    assert trial_rounds(trials[3].user_attrs, trials[3].intermediate_values) == 4
    assert rounds_spent(trials, first_number=1) == 2 + 1 + 4
    assert rounds_spent(trials, first_number=0) == 11


def _cfg(rounds: int, seed: int = 0):
    return load_config(None, [f"trainer.total_rounds={rounds}", f"trainer.seed={seed}"])


def test_sweep_checks_name_the_budget_objective_and_confirm_seeds():
    check_sweep_for(SweepConfig(round_budget=8), _cfg(4))
    with pytest.raises(ConfigError, match=r"round_budget \(3\) is below one trial's trainer.total_rounds \(4\)"):
        check_sweep_for(SweepConfig(round_budget=3), _cfg(4))
    with pytest.raises(ConfigError, match="unknown sweep objective 'area'"):
        check_sweep_for(SweepConfig(objective="area"), _cfg(4))
    with pytest.raises(ConfigError, match=r"holds trainer.seed=7.*fresh seeds"):
        check_sweep_for(SweepConfig(confirm=ConfirmSpec(seeds=[7, 8])), _cfg(4, seed=7))
    with pytest.raises(ConfigError, match="at least 2 seeds"):
        check_sweep_for(SweepConfig(confirm=ConfirmSpec(seeds=[5])), _cfg(4))
    check_sweep_for(SweepConfig(confirm=ConfirmSpec(k=0, seeds=[])), _cfg(4))  # no confirm phase: no seeds needed
    with pytest.raises(ConfigError, match=r"max_resource \(8\) exceeds trainer.total_rounds \(4\)"):
        check_sweep_for(SweepConfig(study=StudySpec(pruner="hyperband", max_resource=8)), _cfg(4))


def _run(storage, spec, study, value: float, rounds: int):
    """One trial that reports `value` after each round, as `decide` does; returns the round it
    was pruned after, or None when it ran all `rounds` (then told COMPLETE)."""
    ((number, _),) = ask_batch(study, default_space(), 1)
    with TrialReporter(storage, spec, number) as rep:
        pruned = next((r for r in range(1, rounds + 1) if rep.report(value, r) and r < rounds), None)
    tell_batch(study, [(number, "PRUNED" if pruned else "COMPLETE", [] if pruned else [value])])
    return pruned


def test_successive_halving_gives_good_trials_all_rounds_and_stops_bad_ones_at_a_rung(tmp_path):
    spec = StudySpec(name="sha", pruner="sha", min_resource=2, reduction_factor=2)
    storage = storage_url(spec, str(tmp_path))
    study = open_study(spec, storage)
    assert isinstance(study.pruner, optuna.pruners.SuccessiveHalvingPruner)
    assert (study.pruner._min_resource, study.pruner._reduction_factor) == (2, 2)
    good = [_run(storage, spec, study, 0.8 + 0.01 * i, 8) for i in range(3)]
    bad = [_run(storage, spec, study, 0.1, 8) for _ in range(2)]
    assert good == [None, None, None]
    assert bad == [2, 2], "a trial below the rung's top half stops at the first rung (round 2)"
    # A trial as good as the best goes on past every rung (rounds 2 and 4) to its last round.
    assert _run(storage, spec, study, 0.9, 8) is None
    trials = optuna.load_study(study_name="sha", storage=storage).trials
    assert [len(t.intermediate_values) for t in trials] == [8, 8, 8, 2, 2, 8]


def test_hyperband_prunes_within_its_brackets(tmp_path):
    spec = StudySpec(name="hb", pruner="hyperband", min_resource=1, reduction_factor=2, max_resource=4)
    storage = storage_url(spec, str(tmp_path))
    study = open_study(spec, storage)
    assert isinstance(study.pruner, optuna.pruners.HyperbandPruner)
    good = [_run(storage, spec, study, 0.9, 4) for _ in range(6)]
    bad = [_run(storage, spec, study, 0.05 + 0.001 * i, 4) for i in range(6)]
    assert good == [None] * 6
    # Each bad trial stops at the first rung of its bracket: round 1 in bracket 0, round 2 in
    # bracket 1 (bracket 2's first rung is max_resource itself); the trials fall in both.
    assert None not in bad and set(bad) == {1, 2}, bad
