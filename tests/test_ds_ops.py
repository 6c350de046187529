"""A stale DeepSpeed build lock (left by a killed JIT build of the CPU shared-memory op) never
hangs a run: the op is not built by default, and with it enabled, locks no live process
holds are removed first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhf.trainer.ds_ops import ENV_USE_SHM, SHM_OP, prepare_cpu_comm, remove_stale_locks, stale_locks
from test_trainer import _clean_env

ROOT = Path(__file__).resolve().parents[1]


def _lock(root: Path, sub: str = "") -> Path:
    path = root / sub / SHM_OP / "lock" if sub else root / SHM_OP / "lock"
    path.parent.mkdir(parents=True)
    path.touch()
    return path


def test_a_lock_no_process_holds_is_stale_and_a_held_one_is_not(tmp_path):
    stale = _lock(tmp_path / "a")
    nested = _lock(tmp_path / "b", "py311_cpu")
    held = _lock(tmp_path / "c")
    fd = os.open(held, os.O_RDONLY)  # as a live builder holds its baton
    try:
        assert stale_locks(tmp_path / "a") == [stale]
        assert stale_locks(tmp_path / "b") == [nested]
        assert stale_locks(tmp_path / "c") == []
        assert remove_stale_locks(tmp_path / "c") == [] and held.exists()
    finally:
        os.close(fd)
    assert remove_stale_locks(tmp_path / "a") == [stale] and not stale.exists()


def test_with_the_op_enabled_a_stale_lock_is_removed_before_the_build(tmp_path, monkeypatch):
    import deepspeed.ops

    lock = _lock(tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv(ENV_USE_SHM, "1")
    before = deepspeed.ops.__compatible_ops__.get(SHM_OP)
    assert prepare_cpu_comm() == "built"
    assert not lock.exists() and deepspeed.ops.__compatible_ops__.get(SHM_OP) == before


@pytest.mark.slow
def test_a_deepspeed_engine_starts_beside_a_stale_build_lock(tmp_path):
    """Real DeepSpeed (gloo on CPU) in a fresh process whose extensions folder holds a stale
    lock: `deepspeed.initialize` returns (without the fix it waits on the lock forever)."""
    lock = _lock(tmp_path / "ext")
    script = textwrap.dedent("""
        import torch
        from rlhf.config import load_config
        from rlhf.trainer import dist as D
        from rlhf.trainer.engines import build_engine, ds_config
        cfg = load_config(None, ["trainer.device=cpu"])
        D.init_distributed(torch.device("cpu"))
        engine = build_engine(torch.nn.Linear(4, 2), ds_config(cfg, cfg.actor.lr, 0.0, 1.0, 1, torch.device("cpu")))
        print("engine ready", type(engine).__name__)
    """)
    env = {**_clean_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    env.pop(ENV_USE_SHM, None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "engine ready" in proc.stdout
    assert lock.exists(), "the default path must not need (or touch) the build folder"
    assert not (tmp_path / "ext" / SHM_OP / "deepspeed_shm_comm.so").exists(), "the op was built"
