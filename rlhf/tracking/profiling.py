"""torch.profiler traces of chosen global steps (`trainer.profile_steps`, as verl's
`global_profiler.steps`), so that the bottleneck of a run can be found without code.

When a round's update holds a listed global step, the update runs under `torch.profiler`
(CPU activity, plus CUDA where the device is a GPU; shapes recorded; a one-window schedule
that covers the whole update) and leaves, next to the checkpoints:

    <dir>/profile/step_<N>/trace.json.gz     Chrome trace: open in https://ui.perfetto.dev
                                             or chrome://tracing
    <dir>/profile/step_<N>/key_averages.txt  every op, sorted by device (else CPU) time
    <dir>/profile/step_<N>/ranges.txt        the trainer's named ranges only: the stages
                                             (old_log_prob, ref, values, adv, update_critic,
                                             update_actor) and, inside the updates, forward,
                                             backward, grad_norm and optimizer_step

The same folder is logged to the tracking sink as artifacts under `profile/step_<N>`.
Under torchrun every rank writes its own files (`trace.rank<r>.json.gz`, ...); rank 0
writes the names above. A round with `steps_per_round` > 1 is traced whole, once: its
behaviour and reference log-probs belong to all of its steps; `<N>` is the first listed
step it holds. Generation is not traced: 512 decode steps of a large batch launch
hundreds of thousands of kernels, a trace too large to open.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
from rlhf.trainer.dist import barrier

PROFILE_DIR = "profile"
RANGE_PREFIXES = ("old_log_prob", "ref", "values", "adv", "update_actor", "update_critic", "actor/", "critic/")
TABLE_ROWS = 80


def steps_in_round(profile_steps: Iterable[int], first_step: int, n_steps: int) -> list[int]:
    """The listed global steps that the round covering `first_step .. first_step + n_steps - 1` holds."""
    return sorted(s for s in set(profile_steps) if first_step <= s < first_step + n_steps)


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / PROFILE_DIR / f"step_{step}"


def _file(name: str, ext: str, rank: int) -> str:
    return f"{name}{ext}" if rank == 0 else f"{name}.rank{rank}{ext}"


def _activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def ranges_table(events, device: torch.device) -> str:
    """The trainer's named ranges (record_function) with their CPU and device totals."""
    rows = []
    for e in events:
        if e.key.startswith(RANGE_PREFIXES) and "::" not in e.key:
            dev = getattr(e, "device_time_total", 0.0) if device.type == "cuda" else 0.0
            rows.append((e.key, e.count, e.cpu_time_total / 1e3, dev / 1e3))
    rows.sort(key=lambda r: -r[2])
    lines = [f"{'range':<28} {'calls':>6} {'cpu_total_ms':>14} {'device_total_ms':>16}"]
    lines += [f"{k:<28} {n:>6} {c:>14.1f} {d:>16.1f}" for k, n, c, d in rows]
    return "\n".join(lines) + "\n"


def export(prof, out: Path, rank: int, device: torch.device) -> list[Path]:
    """Write the Chrome trace (gzip), the ops table and the ranges table atomically."""
    out.mkdir(parents=True, exist_ok=True)
    trace = out / _file("trace", ".json.gz", rank)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        packed = Path(tmp) / "trace.json.gz"
        with open(raw, "rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        os.replace(packed, trace)
    events = prof.key_averages(group_by_input_shape=False)
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    table = out / _file("key_averages", ".txt", rank)
    _atomic_text(table, events.table(sort_by=sort, row_limit=TABLE_ROWS, max_name_column_width=60))
    ranges = out / _file("ranges", ".txt", rank)
    _atomic_text(ranges, ranges_table(events, device))
    return [trace, table, ranges]


class StepProfiler:
    """Traces the updates that hold a listed global step; `update(first, n)` is a context
    manager around one round's update, a no-op for rounds with no listed step."""

    def __init__(self, profile_steps: Iterable[int], root: str | os.PathLike, device: torch.device, rank: int = 0):
        self.steps = sorted(set(int(s) for s in profile_steps))
        bad = [s for s in self.steps if s < 1]
        if bad:
            raise ValueError(f"trainer.profile_steps holds {bad}: global steps start at 1")
        self.root, self.device, self.rank = Path(root), device, rank
        self.written: list[Path] = []  # folders written by this process, in order

    @contextmanager
    def update(self, first_step: int, n_steps: int, sink=None) -> Iterator[Optional[Path]]:
        hit = steps_in_round(self.steps, first_step, n_steps)
        if not hit:
            yield None
            return
        out = step_dir(self.root, hit[0])
        done: list[Path] = []

        def ready(prof) -> None:
            done.extend(export(prof, out, self.rank, self.device))

        with warnings.catch_warnings():  # no warm-up window: it would need a whole update of its own
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = torch.profiler.schedule(wait=0, warmup=0, active=1, repeat=1)
        with torch.profiler.profile(activities=_activities(self.device), schedule=schedule, on_trace_ready=ready,
                                    record_shapes=True, profile_memory=False, with_stack=False) as prof:
            yield out
            prof.step()  # closes the one active window: the trace is written now
        _atomic_text(out / _file("meta", ".json", self.rank),
                     json.dumps({"global_steps": hit, "round_first_step": first_step, "round_steps": n_steps,
                                 "rank": self.rank, "files": [p.name for p in done]}, indent=1))
        self.written.append(out)

        barrier()  # every rank's files are in place before rank 0 logs the folder
        if sink is not None:
            sink.log_artifact(str(out), artifact_path=f"{PROFILE_DIR}/{out.name}")
