"""What the console shows while rounds run: one line per round.

    round 3/100 | step 3 | critic/score/mean 0.41 | val/score 0.38 | actor/current_kl 0.0012 |
        actor/reward_kl_penalty_coeff 0.001 | timing_s/step 2.1 | elapsed 6s | ETA 3m24s

Metric names are the ones the decks and MLflow show (`actor/current_kl` is the KL to the
reference that the early stop and the deck's KL curve use). The ETA assumes the remaining
rounds take as long as the mean round so far (early stops end sooner). The number and
duration formats are the console's everywhere (`rlhf.tracking.sinks`, `rlhf.tracking.results`).
"""

from __future__ import annotations

import math
import sys
from typing import Mapping, TextIO

# The headline metrics of a round line, in order (last step of the round).
ROUND_KEYS = ("critic/score/mean", "actor/current_kl", "actor/reward_kl_penalty_coeff", "actor/pg_loss",
              "response_length/mean", "timing_s/step")


def format_number(x: float) -> str:
    """A metric value in at most four significant digits, or in exponent form when tiny or huge."""
    if math.isnan(x):
        return "nan"
    if x == 0 or 1e-3 <= abs(x) < 1e4:
        return f"{x:.4g}"
    return f"{x:.3e}"


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`; `?` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_seconds(rounds_done: int, total_rounds: int, seconds_per_round: float) -> float:
    """Seconds the remaining rounds take at `seconds_per_round` each (0 when none remain)."""
    left = max(0, total_rounds - rounds_done)
    return left * seconds_per_round if left else 0.0


def round_line(round_: int, total_rounds: int, step: int, last: Mapping[str, float], val: float,
               elapsed_s: float, seconds_per_round: float) -> str:
    """The console line after round `round_` of `total_rounds` (`last`: the round's last step
    metrics; `val` the latest val score, negative when none yet)."""
    parts = [f"round {round_}/{total_rounds}", f"step {step}"]
    for key in ROUND_KEYS[:1]:
        if key in last:
            parts.append(f"{key} {format_number(float(last[key]))}")
    if val >= 0:
        parts.append(f"val/score {format_number(val)}")
    parts += [f"{key} {format_number(float(last[key]))}" for key in ROUND_KEYS[1:] if key in last]
    if math.isfinite(elapsed_s):
        parts.append(f"elapsed {format_duration(elapsed_s)}")
    parts.append(f"ETA {format_duration(eta_seconds(round_, total_rounds, seconds_per_round))}")
    return " | ".join(parts)


def print_line(line: str, stream: TextIO | None = None) -> None:
    """One line, flushed at once, so lines from other writers never land inside it."""
    out = stream or sys.stdout
    out.write(line + "\n")
    out.flush()


def round_seconds(steps: list[Mapping[str, float]]) -> float:
    """A round's measured time from its steps' `timing_s/step` (NaN when not measured)."""
    times = [float(m["timing_s/step"]) for m in steps if "timing_s/step" in m]
    return sum(times) if times else math.nan


def quiet_progress_bars() -> None:
    """No progress bars from the libraries (transformers' weight loading and saving, the hub's
    downloads), so that they never land between the round lines; `RLHF_PROGRESS_BARS=1` keeps them."""
    import os

    if os.environ.get("RLHF_PROGRESS_BARS") == "1":
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
