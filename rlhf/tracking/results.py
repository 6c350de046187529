"""A finished run's results: the summary file (valid JSON only) and the table printed at the end.

`summary.json` never holds `NaN` or `Infinity` (which `json.dumps` writes by default and
which strict JSON readers refuse): a non-finite number is written as `null`, and the keys
that held one are listed under `"nonfinite_keys"`, so that a reader can tell a missing
value from a diverged one. Files are written atomically (temporary file, then rename).

    run results
      val score     0.1380 -> 0.3340 (best 0.3340)
      stop reason   total_rounds reached
      rounds        100 (100 steps)
      wall time     5m12s
      outputs       /abs/outputs
      final policy  /abs/outputs/checkpoints/round_000100/actor
      decks         /tmp/flyte-xyz/.../deck.html
      MLflow run    3f2a... at sqlite:////abs/outputs/mlflow.db
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from rlhf.tracking.progress import format_duration


def json_safe(value: Any, path: str = "", found: list[str] | None = None) -> Any:
    """A copy of `value` (dicts, lists, numbers, strings) with every NaN or infinite float
    replaced by None; the dotted paths of the replaced values are appended to `found`."""
    if isinstance(value, float) and not math.isfinite(value):
        if found is not None:
            found.append(path or "<root>")
        return None
    if isinstance(value, dict):
        return {k: json_safe(v, f"{path}.{k}" if path else str(k), found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return json_safe(value.item(), path, found)
    return value


def dumps(summary: dict, indent: int | None = 2) -> str:
    """Strict JSON text of `summary`: non-finite numbers as null, listed in `nonfinite_keys`."""
    found: list[str] = []
    clean = json_safe(summary, "", found)
    if found:
        clean["nonfinite_keys"] = found
    return json.dumps(clean, indent=indent, allow_nan=False)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_summary(path: str | os.PathLike, summary: dict) -> Path:
    """`summary` as strict JSON at `path`, atomically."""
    return write_text_atomic(path, dumps(summary) + "\n")


def _score(x: Any) -> str:
    return "-" if x is None or not isinstance(x, (int, float)) or x < 0 or not math.isfinite(x) else f"{x:.4f}"


def summary_rows(summary: dict, where: dict[str, str]) -> list[tuple[str, str]]:
    """(label, value) rows of the end-of-run table: scores, stop reason, rounds, wall time,
    then the places in `where` (label -> path or URI) that are known."""
    rows = [("val score", f"{_score(summary.get('val_score_start'))} -> {_score(summary.get('val_score_end'))} "
                          f"(best {_score(summary.get('val_score_best'))})"),
            ("stop reason", str(summary.get("stop_reason") or "-")),
            ("rounds", f"{summary.get('rounds', '?')} ({summary.get('global_steps', '?')} steps)")]
    if summary.get("skipped_steps"):
        rows.append(("skipped steps", str(summary["skipped_steps"])))
    if "wall_s" in summary:
        rows.append(("wall time", format_duration(float(summary["wall_s"]))))
    rows += [(label, value) for label, value in where.items() if value]
    return rows


def summary_table(rows: Iterable[tuple[str, str]], title: str = "run results") -> str:
    """The rows as an aligned two-column text table under `title`."""
    rows = list(rows)
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join([title] + [f"  {label.ljust(width)}  {value}" for label, value in rows])
