"""Checkpoints checked and found: the manifest check, and the rule every path that starts from a
checkpoint follows (verified before its first use).

`why_incomplete` compares a checkpoint with its `manifest.json` (every file's size, and with
`checksums` its digest); `latest_checkpoint` and `round_checkpoints` find a run's checkpoints.

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
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from rlhf.checkpoint.pieces import file_digest
from rlhf.config.schema import ConfigError
from rlhf.trainer import dist as D

log = logging.getLogger("rlhf.checkpoint")

_NAME = re.compile(r"^round_(\d{6})$")
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"  # written last: relative path -> size and digest of every other file


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def round_dir_name(round_: int) -> str:
    return f"round_{round_:06d}"


def why_incomplete(path: Path, checksums: bool = True, part: str = "") -> str:
    """"" for a complete checkpoint, else what is wrong with it. With `checksums`, every file's digest is
    compared with the manifest's (a full read), else sizes only; with `part` ("actor"), that file or directory's."""
    try:
        manifest = json.loads((Path(path) / MANIFEST_FILE).read_text())
        files, algo = manifest["files"], manifest.get("digest")
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (the save did not finish)"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        return f"unreadable {MANIFEST_FILE} ({e})"
    if not isinstance(files, dict):
        return f"unreadable {MANIFEST_FILE} (its 'files' is not a mapping)"
    inside = (lambda name: name == part or name.startswith(f"{part}/")) if part else (lambda name: True)
    for name in filter(inside, (STATE_FILE, "actor/config.json")):
        if name not in files:
            return f"{name} is not listed in {MANIFEST_FILE}"
    for name, entry in filter(lambda item: inside(item[0]), files.items()):
        reason = _why_bad_file(Path(path) / name, name, entry, algo, checksums)
        if reason:
            return reason
    return ""


def _why_bad_file(f: Path, name: str, entry, algo: str | None, checksums: bool) -> str:
    size = entry["size"] if isinstance(entry, dict) else entry  # size-only manifests of older versions
    if not f.is_file():
        return f"{name} is missing"
    if f.stat().st_size != size:
        return f"{name} has {f.stat().st_size} bytes, {size} expected (truncated or overwritten)"
    if checksums and isinstance(entry, dict) and algo:
        got = file_digest(f, algo)
        if got != entry["digest"]:
            return (f"{name} does not match its {algo} digest in {MANIFEST_FILE} ({got} != {entry['digest']}): "
                    "its contents changed after the checkpoint was sealed")
    return ""


def is_complete(path: Path, checksums: bool = True) -> bool:
    return why_incomplete(path, checksums) == ""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint to start from fails its manifest's check (`what`: the checkpoint and the file)."""


def verify(path: Path) -> None:
    """Raise `CorruptCheckpointError` naming what is wrong unless checkpoint `path` is complete
    and every file matches its digest."""
    reason = why_incomplete(Path(path))
    if reason:
        raise corrupt(path, reason)


def corrupt(path: Path, reason: str) -> CorruptCheckpointError:
    e = CorruptCheckpointError(f"checkpoint {path} is not valid: {reason}. Start from an earlier checkpoint of "
                               "the run, or without one (trainer.resume=disable)")
    e.what = f"{path}: {reason}"
    return e


def latest_checkpoint(output_dir: str | os.PathLike, checksums: bool = True) -> Path | None:
    """The newest complete round checkpoint whose files match their digests; incomplete or
    changed ones and left-over temporary directories of an interrupted save are skipped,
    each with a warning naming it."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    for p in sorted(root.glob(".tmp_*")):
        log.warning("ignoring half-written checkpoint %s (a save was interrupted before it was renamed)", p)
    found = [p for _, p in reversed(round_checkpoints(root))]
    for i, path in enumerate(found):
        reason = why_incomplete(path, checksums)
        if not reason:
            return path
        log.warning("checkpoint %s is not valid: %s; %s", path, reason, next_hint(found[i + 1:]))
    return None


def round_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(round, directory) of every round checkpoint directory in `root`, oldest first (valid or not)."""
    return sorted((int(m.group(1)), p) for p in Path(root).iterdir() if (m := _NAME.match(p.name)))


def start_verify(path: Path, rank: int, part: str = "") -> Callable[[], None]:
    """Start checking the files of checkpoint `path` (those under `part/` only, when given)
    against their digests: rank 0 hashes them in a background thread while the caller goes on.
    The function returned waits for that check and tells the other ranks; all raise
    `CorruptCheckpointError` naming the file when one is missing or changed."""
    pending = None
    if rank == 0:
        pool = ThreadPoolExecutor(1, thread_name_prefix="verify")
        pending = pool.submit(why_incomplete, Path(path), True, part)
        pool.shutdown(wait=False)  # its thread ends after this one check

    def wait() -> None:
        reason = D.broadcast_object(pending.result() if pending else None)
        if reason:
            raise corrupt(path, reason)

    return wait


def policy_checkpoint(model_dir: str | os.PathLike) -> Optional[tuple[Path, str]]:
    """(checkpoint directory, model sub-directory) when `model_dir` is a model directory of a
    sealed round checkpoint (its parent's manifest lists `<name>/config.json`), else None (a
    base policy, a model of the user's)."""
    model_dir = Path(model_dir)
    manifest = model_dir.parent / MANIFEST_FILE
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (model_dir.parent, model_dir.name) if f"{model_dir.name}/config.json" in files else None


def resume_candidates(resume: str, output_dir: Path) -> tuple[list[Path], list[str]]:
    """The checkpoints `trainer.resume` may start from, newest first, and what is wrong with
    the ones set aside: "auto", every round checkpoint of the output directory that has its
    manifest and its files at their sizes (`auto_candidates`); "disable", none; a directory,
    that one (refused at once when it is no sealed checkpoint). The digests are checked where
    a candidate is used (`rlhf.train.setup.load_first_valid`)."""
    if resume == "auto":
        return auto_candidates(output_dir)
    if resume == "disable":
        return [], []
    path = Path(resume)
    reason = "it does not exist" if not path.is_dir() else why_incomplete(path, checksums=False)
    if reason:
        raise ConfigError(f"trainer.resume={resume!r} is not a checkpoint to start from: {reason}; give a round "
                          "checkpoint directory (<output_dir>/checkpoints/round_NNNNNN), auto or disable")
    return [path], []


def auto_candidates(output_dir: str | os.PathLike) -> tuple[list[Path], list[str]]:
    """(checkpoints `trainer.resume=auto` may start from, newest first; what is wrong with the
    others). A candidate has its manifest and every file at its listed size; its digests are
    checked where it is used (`start_verify`). Each one set aside is logged, naming the file."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return [], []
    for p in sorted(root.glob(".tmp_*")):
        log.warning("ignoring half-written checkpoint %s (a save was interrupted before it was renamed)", p)
    found = [p for _, p in reversed(round_checkpoints(root))]
    usable, failed = [], []
    for i, path in enumerate(found):
        reason = why_incomplete(path, checksums=False)
        if reason:
            failed.append(f"{path}: {reason}")
            log.warning("checkpoint %s is not valid: %s; %s", path, reason, next_hint(found[i + 1:]))
        else:
            usable.append(path)
    return usable, failed


def next_hint(rest: list) -> str:
    """What the run does after a checkpoint failed, given the ones left to try."""
    return f"trying the next newest, {rest[0]}" if rest else "no earlier checkpoint is left"


def none_valid(failed: list[str], advice: str) -> CorruptCheckpointError:
    """The error when every checkpoint a run could start from failed its check."""
    listed = "; ".join(failed)
    return CorruptCheckpointError(
        f"no checkpoint to start from is valid ({len(failed)} checked): {listed}. {advice}")


def resume_advice(resume: str, output_dir: str | os.PathLike) -> str:
    """What to do when the checkpoints `trainer.resume` names for an in-process run all failed."""
    if resume != "auto":
        return "Start from an earlier checkpoint of the run, or without one (trainer.resume=disable)"
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
