"""The MLflow tracking server unreachable at start or going away mid-run (a real `mlflow
server` on a free port, stopped and restarted on the same SQLite backend store): training
goes on, metrics are buffered to a local file with a warning, and every step reaches the
server exactly once when it is back (in the same run, or sent by the next run)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.tracking.buffer import BufferedMLflowSink
from tests.conftest import _free_port, _stop, _wait_healthy
from tests.test_trainer import tiny_cfg


class Server:
    """`mlflow server` on a fixed port and backend store, that a test can stop and start again."""

    def __init__(self, root: Path, port: int):
        self.root, self.port, self.proc = root, port, None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        if self.proc is not None:
            return
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
               "--default-artifact-root", str(self.root / "artifacts")]
        log = self.root / f"server-{time.monotonic_ns()}.log"
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_healthy(self.url, self.proc, log, timeout=120)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module (each start costs seconds): each test starts or stops it as it needs."""
    s = Server(tmp_path_factory.mktemp("server"), _free_port())
    yield s
    s.stop()


def _steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _metric_records(buffer: Path) -> list[dict]:
    path = buffer / BufferedMLflowSink.PENDING
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["op"] == "metrics"]


@pytest.mark.slow
def test_server_unreachable_at_start_training_goes_on_and_next_run_sends(server, tmp_path, caplog):
    """No server at the configured URL: two rounds train in full (the tracker costs no
    waiting), the run's metrics are kept in `<output_dir>/mlflow_buffer`, and the next run in
    that output directory, with the server up, sends them: every step once."""
    from mlflow.tracking import MlflowClient

    from rlhf.train import train

    server.stop()  # nothing listens on its port
    out = tmp_path / "out"
    cfg = tiny_cfg(out, "trainer.total_rounds=2", "trainer.logger=[mlflow]", "trainer.project_name=faults",
                   f"trainer.mlflow_tracking_uri={server.url}", "trainer.experiment_name=dark-start")
    caplog.set_level(logging.WARNING, logger="rlhf.tracking.sinks")
    t0 = time.monotonic()
    summary = train(cfg)
    wall = time.monotonic() - t0
    assert summary["rounds"] == 2 and summary["global_steps"] == 2
    assert wall < 120, f"training with an unreachable tracker took {wall:.0f}s"
    buffer = out / "mlflow_buffer"
    steps = sorted({r["step"] for r in _metric_records(buffer) if "actor/pg_loss" in r["metrics"]})
    assert steps == [1, 2]
    assert "is unreachable" in caplog.text and "still unreachable at the end of the run" in caplog.text

    server.start()
    train(cfg)  # the next run: already at total_rounds, it only opens its sink and closes
    assert not (buffer / BufferedMLflowSink.PENDING).exists()
    client = MlflowClient(tracking_uri=server.url)
    exp = client.get_experiment_by_name("faults")
    runs = client.search_runs([exp.experiment_id], "tags.mlflow.runName = 'dark-start'")
    (first,) = [r for r in runs if "actor/pg_loss" in r.data.metrics]
    assert _steps(client, first.info.run_id, "actor/pg_loss") == [1, 2]
    assert len(client.get_metric_history(first.info.run_id, "val/accuracy")) == 3  # before + after 2 rounds
    assert first.data.params["trainer.total_rounds"] == "2" and first.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(first.info.run_id)} >= {"summary.json", "final_model"}


@pytest.mark.slow
def test_server_gone_mid_run_is_buffered_and_every_step_arrives_once(server, tmp_path, caplog):
    from mlflow.tracking import MlflowClient

    server.start()
    buffer = tmp_path / "out" / "mlflow_buffer"
    caplog.set_level(logging.WARNING, logger="rlhf.tracking.sinks")
    sink = BufferedMLflowSink(str(buffer), server.url, "faults", "gone-mid-run", retry_s=0)
    sink.log_params({"actor.clip_ratio": 0.2})
    for step in (1, 2, 3):
        sink.log_metrics({"actor/pg_loss": 0.1 * step, "critic/score/mean": step}, step)
    run_id = sink.run_id

    server.stop()
    t0 = time.monotonic()
    for step in (4, 5, 6):
        sink.log_metrics({"actor/pg_loss": 0.1 * step, "critic/score/mean": step}, step)
    assert time.monotonic() - t0 < 15, "logging to a dead server stalled the training loop"
    assert [r["step"] for r in _metric_records(buffer)] == [4, 5, 6]
    assert "is unreachable" in caplog.text and str(buffer) in caplog.text

    server.start()  # same port, same backend store
    for step in (7, 8, 9):
        sink.log_metrics({"actor/pg_loss": 0.1 * step, "critic/score/mean": step}, step)
    assert not (buffer / BufferedMLflowSink.PENDING).exists()
    assert "sent 4 buffered records" in caplog.text  # steps 4-6, then 7
    sink.close()

    client = MlflowClient(tracking_uri=server.url)
    for key in ("actor/pg_loss", "critic/score/mean"):
        assert _steps(client, run_id, key) == list(range(1, 10)), key
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["actor.clip_ratio"] == "0.2"
