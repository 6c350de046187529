"""What a run shows and keeps: one console line per round, the end-of-run table, strict
summary JSON, and in MLflow (a real server over HTTP) the config, curves, final policy
reference and generations; a run that fails after tracking started ends FAILED, in the
in-process driver and in the Flyte workflow."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from rlhf.tracking.progress import format_duration, round_line
from rlhf.tracking.results import summary_rows, summary_table
from test_trainer import TINY, _clean_env, tiny_cfg

ROUND_LINE = re.compile(r"^round (\d+)/(\d+) \| step \d+ \| critic/score/mean \S+ \| val/score \S+ \| "
                        r"actor/current_kl \S+ \| .*timing_s/step \S+ \| elapsed \S+ \| ETA \S+$")


@pytest.fixture(autouse=True)
def _no_flyte_cache(monkeypatch):
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")


# -- pure pieces ----------------------------------------------------------------------------------


def test_round_line_names_metrics_as_the_decks_and_gives_the_eta():
    last = {"critic/score/mean": 0.5, "actor/current_kl": 0.0012, "actor/ppo_kl": 9.0, "timing_s/step": 2.0}
    line = round_line(3, 10, 3, last, 0.25, 65.0, 30.0)
    assert line == ("round 3/10 | step 3 | critic/score/mean 0.5 | val/score 0.25 | actor/current_kl 0.0012 | "
                    "timing_s/step 2 | elapsed 1m05s | ETA 3m30s")
    assert "ppo_kl" not in line and "val/score" not in round_line(1, 2, 1, last, -1.0, 1.0, 1.0)
    assert format_duration(7300) == "2h01m" and format_duration(float("nan")) == "?"


def test_summary_table_gives_scores_reason_time_and_places():
    summary = {"val_score_start": 0.138, "val_score_end": 0.334, "val_score_best": 0.34, "stop_reason": "KL above",
               "rounds": 4, "global_steps": 8, "wall_s": 312.0}
    text = summary_table(summary_rows(summary, {"outputs": "/o", "final policy": "/o/p", "MLflow run": ""}))
    assert text.splitlines() == ["run results", "  val score     0.1380 -> 0.3340 (best 0.3400)",
                                 "  stop reason   KL above", "  rounds        4 (8 steps)", "  wall time     5m12s",
                                 "  outputs       /o", "  final policy  /o/p"]


# -- the in-process driver -------------------------------------------------------------------------


def _mlflow_run(uri: str, experiment: str, name: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{name}'")
    return client, run


def _artifacts(client, run_id: str, path: str = "") -> set[str]:
    out = set()
    for a in client.list_artifacts(run_id, path or None):
        out |= _artifacts(client, run_id, a.path) if a.is_dir and not a.path.startswith("final_model") else {a.path}
    return out


def _check_tracked_results(client, run, policy: str) -> None:
    import mlflow.artifacts

    rid = run.info.run_id
    files = _artifacts(client, rid)
    for name in ("config/config.yaml", "plots/training.html", "plots/training.png", "final_policy.json",
                 "generations/val_step_000000.json"):
        assert name in files, (name, sorted(files))
    ref = json.loads(mlflow.artifacts.load_text(f"{run.info.artifact_uri}/final_policy.json"))
    assert ref["policy"] == policy and ref["global_step"] == 2
    table = json.loads(mlflow.artifacts.load_text(f"{run.info.artifact_uri}/generations/val_step_000002.json"))
    assert table["columns"] == ["step", "data_source", "prompt", "response", "ground_truth", "score"]
    assert 0 < len(table["data"]) <= 8 and all(row[0] == 2 and isinstance(row[5], float) for row in table["data"])
    assert "timing_s/step" in run.data.metrics and run.info.status == "FINISHED"


@pytest.mark.slow
def test_cli_prints_a_line_per_round_and_a_results_table_and_tracks_the_results(tmp_path, mlflow_server):
    name = f"cli-{tmp_path.name}"
    cmd = [sys.executable, "-m", "rlhf.train", *TINY, f"trainer.output_dir={tmp_path / 'out'}", "trainer.total_rounds=2",
           "trainer.logger=[console,mlflow]", f"trainer.mlflow_tracking_uri={mlflow_server}",
           "trainer.project_name=ci-results", f"trainer.experiment_name={name}"]
    proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2 and all(ROUND_LINE.match(line) for line in rounds), rounds
    assert [ROUND_LINE.match(line).group(1, 2) for line in rounds] == [("1", "2"), ("2", "2")]
    assert not re.search(r"^step \d+ \|", proc.stdout, re.M), "a per-step line besides the round line"
    assert "%|" not in proc.stdout + proc.stderr, "a progress bar between the lines"
    table = proc.stdout[proc.stdout.index("run results"):]
    policy = str((tmp_path / "out" / "checkpoints" / "round_000002" / "actor").resolve())
    for row in ("val score", "stop reason   total_rounds reached", "rounds        2 (2 steps)", "wall time",
                f"outputs       {(tmp_path / 'out').resolve()}", f"final policy  {policy}", "MLflow run"):
        assert row in table, (row, table)
    assert "{" not in table, "the end is a repr, not a table"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text(), parse_constant=lambda c: 1 / 0)
    client, run = _mlflow_run(mlflow_server, "ci-results", name)
    assert f"{run.info.run_id} at {mlflow_server}" in table and summary["final_policy"] == policy
    _check_tracked_results(client, run, policy)


@pytest.mark.slow
def test_a_run_that_fails_after_tracking_started_ends_failed(tmp_path, mlflow_server, monkeypatch, one_thread):
    from rlhf.round import stages
    from rlhf.train import train

    def broken_update(*args, **kwargs):
        raise RuntimeError("update broke")

    monkeypatch.setattr(stages, "update", broken_update)
    name = f"fail-{tmp_path.name}"
    cfg = tiny_cfg(tmp_path, "trainer.total_rounds=2", "trainer.logger=[mlflow]", "trainer.project_name=ci-results",
                   f"trainer.mlflow_tracking_uri={mlflow_server}", f"trainer.experiment_name={name}")
    with pytest.raises(RuntimeError, match="update broke"):
        train(cfg)
    _, run = _mlflow_run(mlflow_server, "ci-results", name)
    assert run.info.status == "FAILED" and run.info.end_time is not None


# -- the Flyte workflow -----------------------------------------------------------------------------


@pytest.mark.slow
def test_flyte_launch_prints_rounds_and_results_and_tracks_them(tmp_path, mlflow_server, capfd, one_thread):
    from workflows.ppo import ppo_pipeline

    name = f"flyte-{tmp_path.name}"
    cfg = tiny_cfg(tmp_path, "trainer.total_rounds=2", "trainer.logger=[console,mlflow]",
                   "trainer.project_name=ci-results", f"trainer.mlflow_tracking_uri={mlflow_server}",
                   f"trainer.experiment_name={name}")
    out = ppo_pipeline(cfg=cfg)
    stdout = capfd.readouterr().out
    rounds = [line for line in stdout.splitlines() if line.startswith("round ")]
    assert [line.split(" | ")[0] for line in rounds] == ["round 1/2", "round 2/2"], stdout[-3000:]
    assert all("actor/current_kl" in line and "ETA" in line for line in rounds)
    assert not re.search(r"^step \d+ \|", stdout, re.M)
    table = stdout[stdout.index("run results"):]
    policy = out.model.remote_source or out.model.path
    for row in ("stop reason   total_rounds reached", "rounds        2 (2 steps)", "wall time", f"final policy  {policy}",
                f"{tmp_path}/run_artifacts/training.html", "flytekit's deck.html files under", "MLflow run"):
        assert row in table, (row, table)
    client, run = _mlflow_run(mlflow_server, "ci-results", name)
    _check_tracked_results(client, run, policy)


@pytest.mark.slow
def test_flyte_launch_that_fails_after_tracking_started_ends_failed(tmp_path, mlflow_server, monkeypatch):
    from rlhf.round import stages
    from rlhf.tracking.status import ERROR_TAG
    from workflows.ppo import ppo_pipeline

    def broken_rollout(*args, **kwargs):
        raise RuntimeError("rollout broke")

    monkeypatch.setattr(stages, "rollout", broken_rollout)
    name = f"flyte-fail-{tmp_path.name}"
    cfg = tiny_cfg(tmp_path, "trainer.total_rounds=2", "trainer.logger=[mlflow]", "trainer.project_name=ci-results",
                   f"trainer.mlflow_tracking_uri={mlflow_server}", f"trainer.experiment_name={name}")
    with pytest.raises(Exception, match="rollout broke"):
        ppo_pipeline(cfg=cfg)
    _, run = _mlflow_run(mlflow_server, "ci-results", name)
    assert run.info.status == "FAILED" and "rollout broke" in run.data.tags[ERROR_TAG]
