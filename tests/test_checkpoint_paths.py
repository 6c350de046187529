"""Every path that starts from a checkpoint verifies it before the first use: the Flyte pipeline
resumed from a named checkpoint (both granularities, through flytekit's local execution), the
staged validation, a retried segment's intratask checkpoint (which falls back to the segment's
input), and the in-process resume when every checkpoint is bad (which stops, naming the files,
instead of starting over from round 0). Each damage keeps the file's size: finite noise in the
middle of `actor/model.safetensors`, or the whole file replaced by random bytes."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from rlhf.checkpoint import rounds as ckpt
from rlhf.checkpoint.tensor_files import read_header
from test_pipeline import MOVING, _no_flyte_cache  # noqa: F401 (fixture)
from test_trainer import tiny_cfg

WEIGHTS = "actor/model.safetensors"


def finite_noise(f: Path, n: int = 1024) -> None:
    """Overwrite up to `n` float32 values in the middle of a safetensors file's data with finite
    noise: the file keeps its size and still loads, only its digest tells."""
    size, start = f.stat().st_size, read_header(f)["__size__"]
    n = min(n, (size - start) // 8)
    at = start + ((size - start) // 2 // 4) * 4
    with open(f, "r+b") as out:
        out.seek(at)
        out.write(np.random.default_rng(0).standard_normal(n).astype(np.float32).tobytes())
    assert f.stat().st_size == size


def random_bytes(f: Path) -> None:
    size = f.stat().st_size
    f.write_bytes(os.urandom(size))


def damaged_copy(two_rounds: Path, dest: Path, damage, round_: int = 2) -> Path:
    """A copy of the run's round checkpoint with its actor weights damaged in place."""
    src = ckpt.checkpoint_root(two_rounds) / ckpt.round_dir_name(round_)
    shutil.copytree(src, dest)
    damage(dest / WEIGHTS)
    assert ckpt.is_complete(dest, checksums=False), "sizes alone cannot see the change"
    return dest


def flyte_cfg(two_rounds: Path, out: Path, *extra: str):
    """A launch on the tiny model that made `two_rounds`, one round past its checkpoints."""
    return tiny_cfg(out, *MOVING, f"model.path={two_rounds / 'base_model'}", "trainer.total_rounds=3",
                    "trainer.val_before_train=false", *extra)


# -- the Flyte pipeline resumed from a named checkpoint ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("granularity,damage", [("segment", finite_noise), ("stage", random_bytes)],
                         ids=["segment-noise", "stage-random-bytes"])
def test_flyte_launch_from_a_damaged_checkpoint_stops_naming_the_file(two_rounds, tmp_path, granularity, damage):
    """`trainer.resume=<checkpoint>` on `ppo_pipeline`: the segment checks the checkpoint while it
    builds its trainer, the staged rollout the policy while it builds its engine; either stops
    before a round is trained, naming the file (before: the segment trained on the noise and the
    rollout crashed in sampling, naming no file)."""
    from workflows.ppo import ppo_pipeline

    start = damaged_copy(two_rounds, tmp_path / "start", damage)
    cfg = flyte_cfg(two_rounds, tmp_path / "out", f"trainer.resume={start}", f"trainer.granularity={granularity}")
    with pytest.raises(ckpt.CorruptCheckpointError) as err:
        ppo_pipeline(cfg=cfg)
    message = str(err.value)
    assert f"{start}" in message and f"{WEIGHTS} does not match its" in message and "trainer.resume" in message
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_flyte_resume_point_checks_the_state_file_against_the_manifest(two_rounds, tmp_path):
    """The workflow lays out the rounds left from the checkpoint's `state.json`: a changed one is
    refused, in one line under `pyflyte run` (`LaunchError`), before any task runs."""
    from tasks.base import LaunchError
    from tasks.run import resume_point

    start = tmp_path / "start"
    shutil.copytree(ckpt.checkpoint_root(two_rounds) / "round_000002", start)
    assert resume_point(flyte_cfg(two_rounds, tmp_path, f"trainer.resume={start}"))[1].round == 2
    state = start / ckpt.STATE_FILE
    state.write_text(state.read_text().replace('"round": 2', '"round": 1'))  # same size, another round
    with pytest.raises(LaunchError, match=r"state.json does not match its .* digest"):
        resume_point(flyte_cfg(two_rounds, tmp_path, f"trainer.resume={start}"))


# -- the staged validation and a retried segment ----------------------------------------------------


def test_staged_validation_refuses_a_changed_policy(two_rounds, tmp_path):
    from rlhf.round.state import RoundState
    from rlhf.train import stateless as P

    start = damaged_copy(two_rounds, tmp_path / "start", finite_noise)
    cfg = flyte_cfg(two_rounds, tmp_path / "out")
    val = P.prepare_dataset(cfg.data).val
    with pytest.raises(ckpt.CorruptCheckpointError, match=rf"{WEIGHTS} does not match its"):
        P.evaluate_policy(cfg, str(start / "actor"), val, RoundState.initial(cfg))


def test_a_retried_segment_whose_intratask_checkpoint_is_changed_starts_from_its_input(two_rounds, tmp_path,
                                                                                        caplog):
    """The intratask checkpoint fails its digests: the segment falls back to its input
    checkpoint with the state it was handed, and the warning names the file."""
    from rlhf.train import Run
    from rlhf.train import stateless as P

    given = ckpt.checkpoint_root(two_rounds) / "round_000001"
    resume = damaged_copy(two_rounds, tmp_path / "restored", finite_noise)
    cfg = flyte_cfg(two_rounds, tmp_path / "out")
    data = P.prepare_dataset(cfg.data)
    state = ckpt.read_state(given)
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"):
        run = Run.start(cfg, str(two_rounds / "base_model"), data.train, data.val, given, state,
                        tmp_path / "segment", resume=resume)
    try:
        assert run.resumed_from == str(given) and run.state == state
        run.writer.wait()  # started from a checkpoint, the writer reserves its host buffers at once
        assert run.writer.pool._bufs
    finally:
        run.close()
    assert f"{resume}: {WEIGHTS} does not match" in caplog.text and f"trying the next newest, {given}" in caplog.text


# -- the in-process resume when no checkpoint is left -------------------------------------------------


def test_every_checkpoint_bad_stops_the_run_naming_the_files(two_rounds, tmp_path, caplog, capsys):
    """`python -m rlhf.train` over an output directory whose checkpoints are all damaged stops
    with one message naming each file and what to do; it neither says it uses an earlier one
    nor starts over from round 0 over them (before: both)."""
    from rlhf.train.cli import main

    out = tmp_path / "out"
    shutil.copytree(two_rounds, out)
    root = ckpt.checkpoint_root(out)
    finite_noise(root / "round_000002" / WEIGHTS)
    random_bytes(root / "round_000001" / WEIGHTS)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"), pytest.raises(SystemExit) as stop:
        main(_overrides(out))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no checkpoint to start from is valid (2 checked)") and "Traceback" not in err, err
    for r in (2, 1):
        assert f"{root / ckpt.round_dir_name(r)}: {WEIGHTS} does not match" in err
    assert "new trainer.output_dir" in err and "trainer.resume=disable" in err
    assert "using an earlier one" not in caplog.text and "no earlier checkpoint is left" in caplog.text
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before, "a checkpoint was touched"


def _overrides(out: Path) -> list[str]:
    from test_trainer import TINY

    return [*TINY, *MOVING, f"trainer.output_dir={out}", "trainer.total_rounds=3"]
