"""Colocated segments: the rounds a segment covers, the intratask checkpoint a retried
segment task resumes from (local runs never retry: each attempt is a call of the task with
the previous attempt's checkpoint location as its source), and a thousand rounds through
local Flyte execution without recursion."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from rlhf.train import stateless as P
from rlhf.config import load_config
from rlhf.train.segment import segment_end, segment_starts, should_save
from rlhf.round.state import RoundState
from test_pipeline import _no_flyte_cache, base_model, cfg_for  # noqa: F401 (fixtures)
from test_trainer import TINY


def test_segments_cover_the_rounds_in_blocks_of_k():
    cfg = load_config(None, ["trainer.total_rounds=23", "trainer.rounds_per_segment=10", "trainer.save_freq=4"])
    assert segment_starts(cfg) == [0, 10, 20]
    assert [segment_end(cfg, r) for r in (0, 3, 10, 20, 22)] == [10, 10, 20, 23, 23]
    assert [r for r in range(1, 11) if should_save(cfg, r, 10)] == [4, 8]  # the end writes its own
    never = load_config(None, ["trainer.save_freq=-1"])
    assert not any(should_save(never, r, 100) for r in range(1, 100))


def _attempt(tmp_path: Path, name: str, src: Path | None, inputs: dict):
    """One attempt of `ppo_segment`: its own sandbox and checkpoint location, the previous
    attempt's as the source, as Flyte's entrypoint sets them up for a retry."""
    from flytekit.core.checkpointer import SyncCheckpoint
    from flytekit.core.context_manager import ExecutionParameters, ExecutionState, FlyteContextManager

    from tasks.segment import ppo_segment

    dest = tmp_path / name / "cp"
    dest.mkdir(parents=True)
    ctx = FlyteContextManager.current_context()
    b = ExecutionParameters.new_builder(ctx.user_space_params)
    b.checkpoint = SyncCheckpoint(checkpoint_dest=str(dest), checkpoint_src=str(src) if src else None)
    b.working_dir = str(tmp_path / name)
    state = ctx.execution_state.with_params(mode=ExecutionState.Mode.LOCAL_TASK_EXECUTION,
                                            user_space_params=b.build())
    with FlyteContextManager.with_context(ctx.with_execution_state(state)):
        return ppo_segment.execute(**inputs), dest


def test_retried_segment_resumes_from_its_intratask_checkpoint(
        base_model, tmp_path, monkeypatch):  # noqa: F811 (the fixture imported above)
    """Attempt 1 saves round 2 and dies in round 3; attempt 2 restores round 2 and dies before
    saving (leaving a pointer); attempt 3 follows it and runs rounds 3-5 only. The result is
    the uninterrupted segment's, and each checkpoint location holds one checkpoint."""
    from safetensors.torch import load_file

    from rlhf.train import Run

    cfg = cfg_for(tmp_path / "out", base_model, "trainer.total_rounds=5", "trainer.rounds_per_segment=5",
                  "trainer.save_freq=2", "trainer.test_freq=2")
    data = P.prepare_dataset(cfg.data)
    from flytekit.types.directory import FlyteDirectory

    inputs = dict(cfg=cfg, train=data.train, val=data.val, base_model=FlyteDirectory(path=base_model),
                  checkpoint=None, state=RoundState.initial(cfg), run_id="")
    whole, _ = _attempt(tmp_path, "whole", None, inputs)

    real, ran = Run.update_round, []

    def dies_at(rounds_done: int):
        def update_round(self):
            if self.state.round == rounds_done:
                raise RuntimeError("node preempted")
            ran.append(self.state.round + 1)
            return real(self)
        return update_round

    monkeypatch.setattr(Run, "update_round", dies_at(2))
    with pytest.raises(RuntimeError, match="preempted"):
        _attempt(tmp_path, "a1", None, inputs)
    assert sorted(os.listdir(tmp_path / "a1" / "cp")) == ["round_000002"]
    ran.clear()
    monkeypatch.setattr(Run, "update_round", dies_at(2))  # restored at round 2, dies before any save
    with pytest.raises(RuntimeError, match="preempted"):
        _attempt(tmp_path, "a2", tmp_path / "a1" / "cp", inputs)
    assert ran == [] and os.listdir(tmp_path / "a2" / "cp") == ["latest.json"]
    monkeypatch.setattr(Run, "update_round", dies_at(-1))
    third, dest = _attempt(tmp_path, "a3", tmp_path / "a2" / "cp", inputs)
    assert ran == [3, 4, 5], "the retry re-ran rounds it had a checkpoint of"
    assert sorted(os.listdir(dest)) == ["round_000004"]

    assert third.state.round == whole.state.round == 5 and not third.stopped
    pd.testing.assert_frame_equal(pd.DataFrame(third.state.step_history), pd.DataFrame(whole.state.step_history),
                                  check_like=True, rtol=1e-4, atol=1e-6)
    assert [v["step"] for v in third.state.val_history] == [2.0, 4.0]  # round 5's is the workflow's
    assert third.metrics["step"].tolist() == [1, 2, 3, 4, 5]
    assert len(third.scored) == 8 * 2 and "score" in third.scored
    a = load_file(os.path.join(whole.policy.path, "model.safetensors"))
    b = load_file(os.path.join(third.policy.path, "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)


def test_thousand_rounds_through_local_flyte_execution(tmp_path):
    """1,000 rounds of a trivial config as 10 colocated segments: the chain is flat, so the
    interpreter's default recursion limit and flytekit's sandbox names hold."""
    import sys

    from workflows.ppo import ppo_pipeline

    cfg = load_config(None, TINY + [
        "trainer.total_rounds=1000", "trainer.rounds_per_segment=100", "trainer.save_freq=-1",
        "trainer.val_before_train=false", "trainer.test_freq=100000", "early_stop.enable=false",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "data.max_response_length=2",
        "actor.ppo_micro_batch_size_per_gpu=4", "actor.ppo_epochs=1", "critic.ppo_epochs=1",
        "algorithm.adv_estimator=grpo",
        "model.sft.max_steps=1", "model.sft.stop_at_accuracy=0.0", "data.synthetic.n_train=64",
        f"trainer.output_dir={tmp_path}"])
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default: one level per round would need far more
    try:
        out = ppo_pipeline(cfg=cfg)
        assert sys.getrecursionlimit() == 1000, "the pipeline raised the recursion limit"
    finally:
        sys.setrecursionlimit(before)
    assert out.state.round == 1000 and out.state.global_step == 1000
    assert out.metrics["step"].tolist() == list(range(1, 1001))
    assert [v["step"] for v in out.state.val_history] == [1000.0]


@pytest.mark.slow
def test_new_execution_resumes_from_a_named_checkpoint(base_model, tmp_path):  # noqa: F811 (fixture)
    """`trainer.resume=<checkpoint>`: a Flyte execution picks up where an in-process run left
    off (weights, optimizer state, round state) and gives the round that run would give next."""
    import shutil

    from safetensors.torch import load_file

    from rlhf.checkpoint.rounds import latest_checkpoint
    from rlhf.train import train
    from workflows.ppo import ppo_pipeline

    two = cfg_for(tmp_path / "loop", base_model, "trainer.total_rounds=2", "trainer.val_before_train=false")
    train(two)
    start = tmp_path / "start"
    shutil.copytree(latest_checkpoint(tmp_path / "loop"), start)
    train(cfg_for(tmp_path / "loop", base_model, "trainer.total_rounds=3", "trainer.val_before_train=false"))
    loop = latest_checkpoint(tmp_path / "loop")
    assert loop.name == "round_000003"

    flyte = ppo_pipeline(cfg=cfg_for(tmp_path / "flyte", base_model, "trainer.total_rounds=3",
                                     "trainer.val_before_train=false", f"trainer.resume={start}"))
    loop_state = RoundState.from_json((loop / "state.json").read_text())
    assert (flyte.state.round, flyte.state.global_step) == (3, 3)
    pd.testing.assert_frame_equal(pd.DataFrame(flyte.state.step_history), pd.DataFrame(loop_state.step_history),
                                  check_like=True, rtol=1e-4, atol=1e-6)
    assert flyte.metrics["step"].tolist() == [1, 2, 3]
    a = load_file(str(loop / "actor" / "model.safetensors"))
    b = load_file(os.path.join(flyte.model.download(), "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)


def test_resume_from_a_directory_that_is_no_checkpoint_is_refused(tmp_path):
    from rlhf.config import ConfigError
    from rlhf.train import resume_candidates

    with pytest.raises(ConfigError, match="trainer.resume=.*does not exist"):
        resume_candidates(str(tmp_path / "nowhere"), tmp_path)
    (tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match="manifest"):
        resume_candidates(str(tmp_path / "half"), tmp_path)
    assert resume_candidates("disable", tmp_path) == resume_candidates("auto", tmp_path) == ([], [])
