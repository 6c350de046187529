"""Training killed with SIGKILL and run again with `trainer.resume=auto`: the whole process
right after a round checkpoint appears, and one rank of a 2-rank torchrun job mid-round.
The re-run resumes from the newest complete round checkpoint, loses at most the round in
flight, and ends with the same weights and KL coefficient as an uninterrupted run with the
same seed. The kill comes from outside (a watcher on the checkpoint directory), so the
instant it lands is not chosen by the code under test. The policy has attention dropout, so
the update draws from the global RNG: equality needs each round's draws to depend on the
round alone, not on how many rounds this process has run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rlhf.checkpoint import rounds as ckpt
from tests.test_trainer import TINY, _clean_env, _free_port, tiny_cfg

ROUNDS = 3
EXTRA = [f"trainer.total_rounds={ROUNDS}", "trainer.steps_per_round=1", "algorithm.kl_ctrl.type=adaptive",
         "algorithm.kl_ctrl.target_kl=0.001", "algorithm.kl_ctrl.horizon=50", "early_stop.enable=false",
         "trainer.val_before_train=false", "trainer.test_freq=10", "actor.entropy_coeff=0.05", "actor.lr=5e-3"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A tiny starting policy whose attention dropout is on while training."""
    from rlhf.trainer.default_policy import build_tiny_policy

    path = tmp_path_factory.mktemp("base")
    model, tok = build_tiny_policy(tiny_cfg(path))
    model.config.attention_dropout = 0.3
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return f"model.path={path}"


def _actor(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt.latest_checkpoint(out) / "actor" / "model.safetensors"))


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _actor(a), _actor(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6, msg=k)


def _wait_for_checkpoint(out: Path, round_: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    target = ckpt.checkpoint_root(out) / ckpt.round_dir_name(round_)
    deadline = time.monotonic() + timeout
    while not target.exists():
        assert proc.poll() is None, f"training exited ({proc.returncode}) before checkpoint {target.name}"
        assert time.monotonic() < deadline, f"no checkpoint {target.name} after {timeout:.0f}s"
        time.sleep(0.01)


def _cmd(out: Path, *extra: str, ranks: int = 1) -> list[str]:
    args = ["-m", "rlhf.train", *TINY, *EXTRA, f"trainer.output_dir={out}", *extra]
    if ranks == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            f"--rdzv-endpoint=127.0.0.1:{_free_port()}", *args, f"trainer.n_gpus_per_node={ranks}"]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:  # a file, not a pipe: nobody reads a pipe while the test waits
        return subprocess.Popen(cmd, env=_clean_env(), stdout=f, stderr=subprocess.STDOUT, cwd=log.parent,
                                start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{proc.args[:4]} hung; log tail:\n{log.read_text(errors='replace')[-3000:]}") from None


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_process_killed_after_a_round_resumes_to_the_same_weights(tmp_path, base):
    """The whole training process SIGKILLed as soon as round 1's checkpoint exists (so during
    round 2); the re-run resumes from the newest valid checkpoint and ends equal to an
    uninterrupted run."""
    from rlhf.train import train

    part = tmp_path / "part"
    part.mkdir()
    log = part / "train.log"
    proc = _start(_cmd(part, base), log)

    def kill_after_round_1() -> None:
        _wait_for_checkpoint(part, 1, proc)
        os.killpg(proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_round_1)
    killer.start()
    full = train(tiny_cfg(tmp_path / "full", *EXTRA, base))  # the uninterrupted run, meanwhile
    killer.join()
    assert _finish(proc, log) == -signal.SIGKILL
    done = ckpt.latest_checkpoint(part)
    assert done is not None and ckpt.read_state(done).round < ROUNDS, "the kill landed after the run had ended"

    resumed = train(tiny_cfg(part, *EXTRA, base))
    assert resumed["resumed_from"] == str(done)  # the newest complete checkpoint: only the round in flight lost
    assert resumed["global_steps"] == full["global_steps"] == ROUNDS
    assert resumed["kl_coef"] == pytest.approx(full["kl_coef"], rel=1e-9)
    assert full["kl_coef"] != pytest.approx(0.001, rel=1e-6), "the KL controller never moved; test is vacuous"
    _assert_same_weights(tmp_path / "full", part)


def _worker_pid(agent: int, rank: int, timeout: float = 60) -> int:
    """The pid of torchrun's worker of global rank `rank` (a child of the agent process)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                env = (d / "environ").read_bytes().split(b"\0") if ppid == agent else []
            except (OSError, IndexError, ValueError):
                continue
            if f"RANK={rank}".encode() in env:
                return int(d.name)
        time.sleep(0.1)
    raise AssertionError(f"no worker of rank {rank} under torchrun agent {agent}")


@pytest.mark.slow
def test_rank_killed_mid_round_under_torchrun_resumes_to_the_same_weights(tmp_path, base):
    """2 ranks (gloo): rank 1 SIGKILLed as soon as round 1's checkpoint exists; torchrun ends
    the job; the re-launched job resumes and ends equal to an uninterrupted 2-rank job."""
    full, part = tmp_path / "full", tmp_path / "part"
    for d in (full, part):
        d.mkdir()
    ref = _start(_cmd(full, base, ranks=2), full / "train.log")  # uninterrupted, side by side
    job = _start(_cmd(part, base, ranks=2), part / "train.log")
    victim = _worker_pid(job.pid, rank=1)
    _wait_for_checkpoint(part, 1, job)
    os.kill(victim, signal.SIGKILL)
    assert _finish(job, part / "train.log") != 0, "torchrun reported success after losing a rank"
    done = ckpt.latest_checkpoint(part)
    assert done is not None and ckpt.read_state(done).round < ROUNDS, "the kill landed after the run had ended"
    assert _finish(ref, full / "train.log") == 0, (full / "train.log").read_text(errors="replace")[-3000:]

    again = _start(_cmd(part, base, ranks=2), part / "resume.log")
    assert _finish(again, part / "resume.log") == 0, (part / "resume.log").read_text(errors="replace")[-3000:]
    a, b = _summary(full), _summary(part)
    assert b["resumed_from"] == str(done) and b["world_size"] == 2
    assert a["global_steps"] == b["global_steps"] == ROUNDS
    assert b["kl_coef"] == pytest.approx(a["kl_coef"], rel=1e-9) and a["kl_coef"] != pytest.approx(0.001, rel=1e-6)
    _assert_same_weights(full, part)
