"""The task images' locks agree with their requirements (no network: both are files here).

containers/requirements-{gpu,cpu}.txt pin the direct packages; requirements-*.lock is uv's
resolution of them (`make lock-images`), which the images install. A pin changed, added or
dropped in a requirements file without re-locking makes these fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CONTAINERS = Path(__file__).resolve().parents[1] / "containers"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;#]+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_pins(text: str) -> dict[str, str]:
    """{name: version} of a requirements file; every package line must be an exact pin."""
    pins = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = PIN.match(line)
        if m is None:
            raise ValueError(f"line {n} ({line!r}) is not an exact pin (name==version)")
        pins[_norm(m.group(1))] = m.group(3)
    return pins


def lock_entries(text: str, req_name: str) -> tuple[dict[str, str], set[str]]:
    """({name: version} of every locked package, names uv marks as coming from `req_name`)."""
    versions, direct, current = {}, set(), None
    for line in text.splitlines():
        m = PIN.match(line)
        if m:
            current = _norm(m.group(1))
            versions[current] = m.group(3)
        elif current and line.strip().lstrip("#").strip().startswith(("-r ", "via -r ")):
            if line.strip().endswith(req_name):
                direct.add(current)
    return versions, direct


def disagreements(req_text: str, lock_text: str, req_name: str) -> list[str]:
    """What differs between a requirements file and its lock, one line each."""
    pins = requirement_pins(req_text)
    locked, direct = lock_entries(lock_text, req_name)
    out = [f"{n}: required {v}, locked {locked.get(n, 'nothing')}" for n, v in sorted(pins.items())
           if locked.get(n) != v]
    out += [f"{n}: locked as a requirement of {req_name} but not required there" for n in sorted(direct - set(pins))]
    out += [f"{n}: required but the lock does not name {req_name} as its source" for n in sorted(set(pins) - direct)
            if n in locked]
    return out


@pytest.mark.parametrize("image", ["gpu", "cpu"])
def test_lock_matches_requirements(image):
    req, lock = CONTAINERS / f"requirements-{image}.txt", CONTAINERS / f"requirements-{image}.lock"
    bad = disagreements(req.read_text(), lock.read_text(), f"containers/{req.name}")
    assert not bad, f"{lock.name} is out of date with {req.name} (run make lock-images):\n" + "\n".join(bad)
    assert lock.read_text().splitlines()[1].strip() == "#    make lock-images", "the lock names the command that makes it"


def test_check_catches_a_changed_added_or_dropped_pin():
    req = (CONTAINERS / "requirements-gpu.txt").read_text()
    lock = (CONTAINERS / "requirements-gpu.lock").read_text()
    name = "containers/requirements-gpu.txt"
    assert disagreements(req.replace("vllm==0.26.0", "vllm==0.26.1"), lock, name) == [
        "vllm: required 0.26.1, locked 0.26.0"]
    assert disagreements(req + "einops==0.8.1\n", lock, name)[0].startswith("einops: required 0.8.1, locked")
    assert disagreements(req.replace("optuna==4.9.0\n", ""), lock, name) == [
        f"optuna: locked as a requirement of {name} but not required there"]
    with pytest.raises(ValueError, match="line 1 .*not an exact pin"):
        requirement_pins("vllm>=0.26\n")


def test_images_install_the_locks():
    from containers.images import CPU_IMAGE, GPU_IMAGE

    assert Path(GPU_IMAGE.requirements).name == "requirements-gpu.lock"
    assert Path(CPU_IMAGE.requirements).name == "requirements-cpu.lock"
    docker = (CONTAINERS / "Dockerfile").read_text()
    assert "-r /tmp/requirements.lock" in docker and "requirements-gpu.lock" in docker
    assert "requirements-gpu.txt" not in docker and "requirements-cpu.txt" not in docker
