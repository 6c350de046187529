"""Checkpoints verified before their first use: the rule every path that starts from one follows.

A run starts from a checkpoint in these ways: the in-process driver's resume
(`trainer.resume=auto` or a directory), a colocated segment's input (the previous segment's
checkpoint, or `trainer.resume=<URI>` on Flyte), a segment's own intratask checkpoint after a
retry, the staged update's input, and the policy inside a checkpoint that the staged rollout
and validation load. Each of them reaches the files through `rlhf.train.setup` (`load_trainer`,
`load_first_valid`, `policy_engine`), which use this module:

- `start_verify(path, rank)`: rank 0 hashes every file against `manifest.json` in a background
  thread while the caller goes on (building the trainer or the rollout engine, preparing the
  data); the function returned waits for it and raises `CorruptCheckpointError` naming the file
  on every rank. `part="actor"` checks one model directory of the checkpoint (a policy).
- `resume_candidates` / `auto_candidates`: the checkpoints `trainer.resume` may start from,
  newest first, those that fail the cheap check (manifest present, every file at its size)
  already set aside.
- `none_valid`: the error when no checkpoint to start from is left, naming every file that
  failed and what to do; a run never starts over from round 0 in silence over checkpoints
  that exist.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from rlhf.config.schema import ConfigError
from rlhf.round import checkpoint as ckpt
from rlhf.trainer import dist as D

log = logging.getLogger("rlhf.round.checkpoint")


def start_verify(path: Path, rank: int, part: str = "") -> Callable[[], None]:
    """Start checking the files of checkpoint `path` (those under `part/` only, when given)
    against their digests: rank 0 hashes them in a background thread while the caller goes on.
    The function returned waits for that check and tells the other ranks; all raise
    `CorruptCheckpointError` naming the file when one is missing or changed."""
    pending = None
    if rank == 0:
        pool = ThreadPoolExecutor(1, thread_name_prefix="verify")
        pending = pool.submit(ckpt.why_incomplete, Path(path), True, part)
        pool.shutdown(wait=False)  # its thread ends after this one check

    def wait() -> None:
        reason = D.broadcast_object(pending.result() if pending else None)
        if reason:
            raise ckpt.corrupt(path, reason)

    return wait


def policy_checkpoint(model_dir: str | os.PathLike) -> Optional[tuple[Path, str]]:
    """(checkpoint directory, model sub-directory) when `model_dir` is a model directory of a
    sealed round checkpoint (its parent's manifest lists `<name>/config.json`), else None (a
    base policy, a model of the user's)."""
    model_dir = Path(model_dir)
    manifest = model_dir.parent / ckpt.MANIFEST_FILE
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (model_dir.parent, model_dir.name) if f"{model_dir.name}/config.json" in files else None


def resume_candidates(resume: str, output_dir: Path) -> tuple[list[Path], list[str]]:
    """The checkpoints `trainer.resume` may start from, newest first, and what is wrong with
    the ones set aside: "auto", every round checkpoint of the output directory that has its
    manifest and its files at their sizes (`auto_candidates`); "disable",
    none; a directory, that one (refused at once when it is no sealed checkpoint). The
    digests are checked where a candidate is used (`setup.load_first_valid`)."""
    if resume == "auto":
        return auto_candidates(output_dir)
    if resume == "disable":
        return [], []
    path = Path(resume)
    reason = "it does not exist" if not path.is_dir() else ckpt.why_incomplete(path, checksums=False)
    if reason:
        raise ConfigError(f"trainer.resume={resume!r} is not a checkpoint to start from: {reason}; give a round "
                          "checkpoint directory (<output_dir>/checkpoints/round_NNNNNN), auto or disable")
    return [path], []


def auto_candidates(output_dir: str | os.PathLike) -> tuple[list[Path], list[str]]:
    """(checkpoints `trainer.resume=auto` may start from, newest first; what is wrong with the
    others). A candidate has its manifest and every file at its listed size; its digests are
    checked where it is used (`start_verify`). Each one set aside is logged, naming the file."""
    root = ckpt.checkpoint_root(output_dir)
    if not root.is_dir():
        return [], []
    for p in sorted(root.glob(".tmp_*")):
        log.warning("ignoring half-written checkpoint %s (a save was interrupted before it was renamed)", p)
    found = [p for _, p in reversed(ckpt.round_checkpoints(root))]
    usable, failed = [], []
    for i, path in enumerate(found):
        reason = ckpt.why_incomplete(path, checksums=False)
        if reason:
            failed.append(f"{path}: {reason}")
            log.warning("checkpoint %s is not valid: %s; %s", path, reason, next_hint(found[i + 1:]))
        else:
            usable.append(path)
    return usable, failed


def next_hint(rest: list) -> str:
    """What the run does after a checkpoint failed, given the ones left to try."""
    return f"trying the next newest, {rest[0]}" if rest else "no earlier checkpoint is left"


def none_valid(failed: list[str], advice: str) -> ckpt.CorruptCheckpointError:
    """The error when every checkpoint a run could start from failed its check."""
    listed = "; ".join(failed)
    return ckpt.CorruptCheckpointError(
        f"no checkpoint to start from is valid ({len(failed)} checked): {listed}. {advice}")


def resume_advice(output_dir: str | os.PathLike) -> str:
    """What to do when every checkpoint of an in-process run's output directory failed."""
    return (f"Nothing was trained or overwritten. Restore those files from a copy, or start over from the base "
            f"policy in a new trainer.output_dir (trainer.resume=disable would start at round 0 in {output_dir} "
            "and replace these checkpoints as it saves)")


def earlier_advice(checkpoints: list[str], current: str) -> str:
    """What to do when a checkpoint handed to a task failed: start from an earlier one of the
    run (their URIs, from the round state), or without one."""
    earlier = [c for c in checkpoints if c.rstrip("/") != str(current).rstrip("/")]
    listed = f" (this run's earlier ones: {', '.join(earlier)})" if earlier else ""
    return (f"Start a new launch from an earlier checkpoint of the run with trainer.resume=<its directory or URI>"
            f"{listed}, or without one (trainer.resume=disable)")
