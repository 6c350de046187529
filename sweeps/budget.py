"""The sweep's budget of PPO rounds: rounds this launch's trials spent, and how many
trials the next batch may ask so that the launch stays within `SweepConfig.round_budget`.

A trial asked reserves its full `trainer.total_rounds`; once told, it counts only the
rounds it ran, so the rounds a pruner saved go to later trials. A trial is asked only
while the rest of the budget holds its full rounds; the sweep stops asking after that.
"""

from __future__ import annotations

from typing import Iterable

ROUNDS_ATTR = "rounds_run"  # user attr: the rounds a told trial ran


def trial_rounds(user_attrs: dict, intermediate_values: dict) -> int:
    """Rounds a finished trial ran: the count told with it, else (a trial that raised)
    the rounds it reported to the study."""
    if ROUNDS_ATTR in user_attrs:
        return int(user_attrs[ROUNDS_ATTR])
    return len(intermediate_values)


def rounds_spent(trials: Iterable, first_number: int) -> int:
    """Rounds spent by the trials numbered `first_number` and later (this launch)."""
    return sum(trial_rounds(t.user_attrs, t.intermediate_values) for t in trials if t.number >= first_number)


def next_batch_size(batch_size: int, trials_left: int, round_budget: int, spent: int, max_rounds: int) -> int:
    """Trials the next batch asks (0: the sweep stops): at most `batch_size` and the
    trials left, and, with a budget (`round_budget` > 0), only as many as the unspent
    rounds can run to their last round (`max_rounds` each)."""
    if max_rounds <= 0:
        raise ValueError(f"a trial's rounds (trainer.total_rounds) must be > 0, got {max_rounds}")
    k = min(batch_size, trials_left)
    if round_budget > 0:
        k = min(k, (round_budget - spent) // max_rounds)
    return max(k, 0)
