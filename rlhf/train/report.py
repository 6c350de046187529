"""A run's report, the same for every driver: the round line with its ETA after each round
(`RoundClock`, `print_round`), the end summary (`end_summary`) and what goes to the tracker
at the end (`publish`)."""

from __future__ import annotations

import time
from typing import Mapping, Optional

from rlhf.config.schema import PPOConfig
from rlhf.round.state import RoundState
from rlhf.tracking.artifacts import log_results
from rlhf.tracking.progress import print_line, round_line, round_seconds


class RoundClock:
    """The time a round takes, for the ETA: measured from the clock's start over the rounds
    since (`RoundClock(round_)` starts it now, before round `round_ + 1`); a clock started at
    its first line (`RoundClock()`) takes that round's time from its steps' stage timings."""

    def __init__(self, round_: Optional[int] = None):
        self.origin: Optional[tuple[float, int]] = None if round_ is None else (time.monotonic(), round_)

    def per_round(self, round_: int, steps: list[Mapping[str, float]]) -> float:
        """Seconds per round after round `round_`, whose steps' metrics are `steps`."""
        now = time.monotonic()
        if self.origin is None or round_ <= self.origin[1]:
            self.origin = (now, round_)
            return round_seconds(steps)
        return (now - self.origin[0]) / (round_ - self.origin[1])


def print_round(cfg: PPOConfig, state: RoundState, steps: list[Mapping[str, float]], elapsed_s: float,
                clock: RoundClock) -> None:
    """The round's console line: k/N, step, headline metrics of its last step, time per
    round, elapsed (`elapsed_s`; NaN: not known), ETA."""
    last = {**(state.step_history[-1] if state.step_history else {}), **(steps[-1] if steps else {})}
    print_line(round_line(state.round, cfg.trainer.total_rounds, state.global_step, last, state.last_val,
                          elapsed_s, clock.per_round(state.round, steps)))


def stop_reason(cfg: PPOConfig, state: RoundState) -> str:
    """Why the rounds ended: the early-stop reason, or the round budget."""
    if state.stop_reason:
        return state.stop_reason
    return "total_rounds reached" if state.round >= cfg.trainer.total_rounds else ""


def summary(cfg: PPOConfig, state: RoundState) -> dict:
    """The run summary every driver reports (`end_summary` adds the driver's entries)."""
    return {
        "val_score_start": state.val_start,
        "val_score_end": state.last_val,
        "val_score_best": state.best_val,
        "rounds": state.round,
        "global_steps": state.global_step,
        "stop_reason": stop_reason(cfg, state),
        "kl_coef": state.kl_coef,
        "skipped_steps": state.skipped_steps,
        "val_history": state.val_history,
    }


def end_summary(cfg: PPOConfig, state: RoundState, reason: str = "", **extra) -> dict:
    """The run summary (`summary`), `reason` as the stop reason when given, the driver's
    `extra` entries (wall time, paths), the validation history last."""
    out = summary(cfg, state)
    if reason:
        out["stop_reason"] = reason
    val_history = out.pop("val_history")
    out.update(extra)
    out["val_history"] = val_history
    return out


def publish(sink, cfg: PPOConfig, state: RoundState, summary: dict, policy: str, out_dir: str) -> None:
    """The end of a run in the tracker: the summary's numbers as metrics, the stop reason as a
    tag, the config, curves and final policy reference (`log_results`)."""
    reason = summary.get("stop_reason", "")
    sink.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))}, step=state.global_step)
    sink.set_tags({"stop_reason": reason})
    log_results(sink, cfg, state, reason, policy, out_dir)
