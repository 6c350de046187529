"""Round checkpoints, written atomically and found again on resume.

Layout: `<output_dir>/checkpoints/round_000003/` holding `actor/` and `critic/`
(safetensors + tokenizer, loadable by any HF tool), `engine/` (DeepSpeed optimizer
state), and `state.json` (the `RoundState`). A checkpoint is written under a hidden
temporary name and renamed into place only when complete, so a crash mid-save never
leaves a directory that reads as valid.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

_NAME = re.compile(r"^round_(\d{6})$")
STATE_FILE = "state.json"


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def round_dir_name(round_: int) -> str:
    return f"round_{round_:06d}"


def tmp_dir_for(root: Path, round_: int) -> Path:
    return root / f".tmp_{round_dir_name(round_)}"


def is_complete(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / "actor" / "config.json").is_file()


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete round checkpoint; incomplete ones are skipped with a warning."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))
    for _, path in reversed(found):
        if is_complete(path):
            return path
        log.warning("checkpoint %s is incomplete (no %s or actor weights); using an earlier one", path, STATE_FILE)
    for p in root.glob(".tmp_*"):
        log.warning("ignoring half-written checkpoint %s", p)
    return None


def commit(tmp: Path, final: Path) -> None:
    """Move a fully written temporary checkpoint into place (atomic rename on one filesystem)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def prune(output_dir: str | os.PathLike, keep: int) -> None:
    root = checkpoint_root(output_dir)
    found = sorted(p for p in root.iterdir() if _NAME.match(p.name))
    for p in found[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
