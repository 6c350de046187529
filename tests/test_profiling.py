"""`trainer.profile_steps`: torch.profiler traces of chosen global steps, on disk and in MLflow."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from rlhf.tracking.profiling import StepProfiler, step_dir, steps_in_round

STAGES = ("old_log_prob", "ref", "values", "update_actor", "update_critic")


def test_steps_in_round_picks_the_listed_steps_a_round_holds():
    assert steps_in_round([2, 5, 9], first_step=1, n_steps=1) == []
    assert steps_in_round([2, 5, 9], first_step=2, n_steps=1) == [2]
    assert steps_in_round([9, 5, 2, 5], first_step=4, n_steps=3) == [5]
    assert steps_in_round([4, 5, 6, 7], first_step=4, n_steps=3) == [4, 5, 6]


def test_bad_step_is_refused_with_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.profile_steps.*\[0\]"):
        StepProfiler([0, 3], tmp_path, torch.device("cpu"))


def test_unlisted_round_writes_nothing(tmp_path):
    prof = StepProfiler([3], tmp_path, torch.device("cpu"))
    with prof.update(1, 2) as out:
        torch.ones(4).sum()
    assert out is None and not (tmp_path / "profile").exists() and prof.written == []


@pytest.mark.slow
def test_profiled_step_leaves_trace_and_mlflow_artifacts(tmp_path, mlflow_server):
    """Two tiny rounds with profile_steps=[2]: only step 2 is traced; the trace parses and holds
    every stage's range; the tables list them; the MLflow run lists the files."""
    from mlflow.tracking import MlflowClient

    from rlhf.train import train
    from tests.test_trainer import tiny_cfg

    name = f"prof-{tmp_path.name}"
    cfg = tiny_cfg(tmp_path, "trainer.total_rounds=2", "trainer.profile_steps=[2]", "trainer.logger=[mlflow]",
                   f"trainer.mlflow_tracking_uri={mlflow_server}", "trainer.project_name=ci-profile",
                   f"trainer.experiment_name={name}", "trainer.test_freq=5", "trainer.val_before_train=false")
    summary = train(cfg)
    assert summary["global_steps"] == 2
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step_2"]
    out = step_dir(tmp_path, 2)
    with gzip.open(out / "trace.json.gz", "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    for stage in STAGES + ("actor/backward", "critic/optimizer_step"):
        assert stage in names, stage
    ranges = (out / "ranges.txt").read_text()
    assert all(s in ranges for s in STAGES)
    assert "aten::" in (out / "key_averages.txt").read_text()
    assert json.loads((out / "meta.json").read_text())["global_steps"] == [2]

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("ci-profile")
    (run,) = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{name}'")
    listed = {a.path for a in client.list_artifacts(run.info.run_id, "profile/step_2")}
    assert {"profile/step_2/trace.json.gz", "profile/step_2/key_averages.txt",
            "profile/step_2/ranges.txt"} <= listed
    assert [a.path for a in client.list_artifacts(run.info.run_id, "profile")] == ["profile/step_2"]
