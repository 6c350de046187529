"""The Flyte intratask checkpoint of a colocated segment: the newest round checkpoint only.

Flyte gives every attempt of a task its own checkpoint location and the previous attempt's
as the source to restore from (`current_context().checkpoint`). A segment keeps one round
checkpoint there, `<dest>/round_NNNNNN/`, removing the older one once the newer is
uploaded (a retry would otherwise download every round the attempt saved). An attempt
that restored a checkpoint and fails before saving its own leaves a pointer to it
(`latest.json`), so the attempt after it still finds that checkpoint instead of none.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Optional

from flytekit import current_context
from flytekit.core.context_manager import FlyteContextManager

from rlhf.checkpoint import rounds as ckpt

log = logging.getLogger(__name__)
POINTER = "latest.json"
_ROUND = re.compile(r"^round_\d{6}$")


def _dest() -> Optional[str]:
    cp = current_context().checkpoint
    return getattr(cp, "_checkpoint_dest", None) if cp is not None else None


def _join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)


def restore() -> Optional[Path]:
    """The newest sealed round checkpoint a previous attempt of this task left, downloaded
    once per pod (every rank calls this; the first one downloads); None on a first attempt,
    or when what is there is not a sealed checkpoint with every file at its size."""
    import fcntl
    import hashlib
    import tempfile

    cp = current_context().checkpoint
    src = getattr(cp, "_checkpoint_src", None) if cp is not None else None
    if not src:
        return None
    into = Path(tempfile.gettempdir()) / "flyte-rlhf-inputs" / f"cp-{hashlib.sha256(src.encode()).hexdigest()[:16]}"
    into.mkdir(parents=True, exist_ok=True)
    with open(f"{into}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = Path(f"{into}.done")
        if not done.is_file():
            found = _download(cp, src, into)
            done.write_text(str(found or ""))
        found = done.read_text()
    return Path(found) if found else None


def _download(cp, src: str, into: Path) -> Optional[Path]:
    try:
        got = Path(cp.restore(into))
    except Exception as e:  # an attempt that failed before its first save left nothing there
        log.warning("no intratask checkpoint restored from %s: %s", src, e)
        return None
    rounds = sorted(p for p in got.iterdir() if _ROUND.match(p.name))
    uri = _join(src, rounds[-1].name) if rounds else ""
    if not rounds and (got / POINTER).is_file():
        uri = json.loads((got / POINTER).read_text())["uri"]
        local = got / uri.rstrip("/").rsplit("/", 1)[-1]
        FlyteContextManager.current_context().file_access.download_directory(uri, str(local))
        rounds = [local]
    if not rounds:
        return None
    # Sealed, every file at its size; the digests are checked by the segment while it starts
    # (`rlhf.train.setup.load_first_valid`), which falls back to the segment's input on a mismatch.
    reason = ckpt.why_incomplete(rounds[-1], checksums=False)
    if reason:
        log.warning("intratask checkpoint %s is not valid (%s); the segment starts from its input", uri, reason)
        return None
    _write_pointer(uri)
    return rounds[-1]


def save(path: Path) -> None:
    """Upload round checkpoint `path` as this attempt's intratask checkpoint, then remove
    what this attempt saved before (the previous round, the pointer)."""
    dest = _dest()
    if dest is None:
        return
    fa = FlyteContextManager.current_context().file_access
    fa.upload_directory(str(path), _join(dest, path.name))
    fs = fa.get_filesystem_for_path(dest)
    for entry in fs.ls(dest, detail=False):
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        if name != path.name and (_ROUND.match(name) or name == POINTER):
            fs.rm(entry, recursive=True)


def _write_pointer(uri: str) -> None:
    """Record in this attempt's checkpoint location where the restored checkpoint lives."""
    dest = _dest()
    if dest is None:
        return
    ctx = FlyteContextManager.current_context()
    local = Path(ctx.file_access.get_random_local_directory()) / POINTER
    local.write_text(json.dumps({"uri": uri}))
    ctx.file_access.upload(str(local), _join(dest, POINTER))
