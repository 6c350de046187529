import io
import math
import os
import uuid

import numpy as np
import pytest
import torch

from rlhf.config import PPOConfig, flatten, from_dict
from rlhf.tracking.buffer import BufferedMLflowSink
from rlhf.tracking.make import make_sink
from rlhf.tracking.sinks import (
    PARAM_VALUE_MAX,
    ConsoleSink,
    MLflowSink,
    MultiSink,
    NullSink,
    Sink,
    clean_metrics,
    format_step,
    mlflow_key,
    param_value,
)

STEP_METRICS = [
    {"critic/score/mean": 0.25, "actor/ppo_kl": 0.0012, "response_length/mean": 12.5, "actor/pg_loss": -0.02},
    {"critic/score/mean": 0.5, "actor/ppo_kl": float("nan"), "response_length/mean": 11.0, "actor/pg_loss": 0.01},
    {"critic/score/mean": 0.75, "actor/ppo_kl": 0.0030, "response_length/mean": 10.0, "actor/pg_loss": 0.03,
     "val-core/openai/gsm8k/reward/mean@1": 0.6},
]


# ---------------------------------------------------------------------------------
# Pure helpers and the console
# ---------------------------------------------------------------------------------


def test_clean_metrics_converts_scalars_and_maps_nonfinite_to_nan():
    out = clean_metrics({"a": np.float32(0.5), "b": torch.tensor(2.0), "c": 3, "d": float("inf"),
                         "e": -float("inf"), "f": float("nan")})
    assert out["a"] == 0.5 and out["b"] == 2.0 and out["c"] == 3.0
    assert all(math.isnan(out[k]) for k in "def")
    assert all(type(v) is float for v in out.values())
    with pytest.raises(TypeError, match="'note'"):
        clean_metrics({"note": "hello"})


def test_mlflow_key_replaces_what_mlflow_refuses():
    assert mlflow_key("val-core/openai/gsm8k/reward/mean@1") == "val-core/openai/gsm8k/reward/mean_at_1"
    assert mlflow_key("timing_s/gen step:1.5") == "timing_s/gen step:1.5"
    assert mlflow_key("a<b>|c") == "a_b__c"


def test_param_value_stringifies_and_caps_length():
    assert param_value(["console", "mlflow"]) == '["console", "mlflow"]'
    assert param_value(None) == "None" and param_value(0.2) == "0.2"
    long = param_value("x" * 10_000)
    assert len(long) == PARAM_VALUE_MAX and long.endswith("...")


def test_console_prints_one_compact_line_per_step():
    """Named as the decks name them: the KL shown is `actor/current_kl`, not `actor/ppo_kl`."""
    out = io.StringIO()
    sink = ConsoleSink(stream=out)
    for step, m in enumerate(STEP_METRICS):
        m = {("actor/current_kl" if k == "actor/ppo_kl" else k): v for k, v in m.items()}
        sink.log_metrics({**m, "actor/ppo_kl": 9.0}, step)
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 0 | critic/score/mean 0.25 | actor/current_kl 0.0012 | actor/pg_loss -0.02 | response_length/mean 12.5",
        "step 1 | critic/score/mean 0.5 | actor/current_kl nan | actor/pg_loss 0.01 | response_length/mean 11",
        "step 2 | critic/score/mean 0.75 | actor/current_kl 0.003 | actor/pg_loss 0.03 | response_length/mean 10 | "
        "val-core/openai/gsm8k/reward/mean@1 0.6",
    ]


def test_format_step_uses_scientific_notation_for_tiny_and_huge_values():
    line = format_step({"actor/current_kl": 1.5e-6, "critic/vf_loss": 123456.0}, 7)
    assert line == "step 7 | actor/current_kl 1.500e-06 | critic/vf_loss 1.235e+05"


def test_sinks_satisfy_the_protocol():
    assert isinstance(NullSink(), Sink) and isinstance(ConsoleSink(), Sink)
    assert isinstance(MultiSink([NullSink()]), Sink)


def test_multisink_forwards_to_every_sink():
    a, b = io.StringIO(), io.StringIO()
    MultiSink([ConsoleSink(stream=a), NullSink(), ConsoleSink(stream=b)]).log_metrics({"actor/current_kl": 0.5}, 4)
    assert a.getvalue() == b.getvalue() == "step 4 | actor/current_kl 0.5\n"


# ---------------------------------------------------------------------------------
# MLflow: a SQLite store, read back with MlflowClient
# ---------------------------------------------------------------------------------


def _log_run(sink: MLflowSink, cfg: PPOConfig, artifact) -> None:
    sink.log_params(flatten(cfg))
    for step, m in enumerate(STEP_METRICS):
        sink.log_metrics(m, step)
    sink.set_tags({"stop_reason": "total_rounds"})
    sink.log_artifact(str(artifact), "reports")
    sink.close()


def _check_run(client, run_id: str, cfg: PPOConfig) -> None:
    run = client.get_run(run_id)
    params = run.data.params
    assert len(params) == len(flatten(cfg))
    assert params["actor.clip_ratio"] == "0.2" and params["trainer.logger"] == '["console"]'
    assert params["actor.clip_ratio_low"] == "None"
    assert run.data.tags["stop_reason"] == "total_rounds"
    assert run.info.status == "FINISHED"
    score = client.get_metric_history(run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in sorted(score, key=lambda m: m.step)] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    kl = sorted(client.get_metric_history(run_id, "actor/ppo_kl"), key=lambda m: m.step)
    assert [m.step for m in kl] == [0, 1, 2] and math.isnan(kl[1].value)
    val = client.get_metric_history(run_id, "val-core/openai/gsm8k/reward/mean_at_1")
    assert [(m.step, m.value) for m in val] == [(2, 0.6)]
    assert set(run.data.metrics) == {mlflow_key(k) for m in STEP_METRICS for k in m}
    assert [f.path for f in client.list_artifacts(run_id, "reports")] == ["reports/summary.json"]


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory):
    """One SQLite store for the module: creating a store runs MLflow's schema migrations (seconds)."""
    root = tmp_path_factory.mktemp("mlflow_sqlite")
    return f"sqlite:///{root}/mlflow.db"


@pytest.fixture
def artifact(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text('{"accuracy": 0.75}')
    return path


def test_mlflow_sqlite_roundtrip(sqlite_uri, artifact):
    from mlflow.tracking import MlflowClient

    cfg = PPOConfig()
    sink = MLflowSink(sqlite_uri, experiment="exp-sqlite", run_name="run-1")
    _log_run(sink, cfg, artifact)

    client = MlflowClient(tracking_uri=sqlite_uri)
    _check_run(client, sink.run_id, cfg)
    assert client.get_run(sink.run_id).info.run_name == "run-1"
    store_dir = os.path.dirname(sqlite_uri[len("sqlite:///"):])
    assert os.path.isdir(os.path.join(store_dir, "mlartifacts")), "artifacts must sit beside the SQLite file"


def test_mlflow_logs_a_step_in_one_request(sqlite_uri):
    sink = MLflowSink(sqlite_uri, experiment="exp-one-request")
    calls = []
    log_batch = sink.client.log_batch
    sink.client.log_batch = lambda *a, **k: (calls.append(k), log_batch(*a, **k))[1]
    sink.log_metrics({f"m/{i}": float(i) for i in range(30)}, step=0)
    assert len(calls) == 1 and len(calls[0]["metrics"]) == 30


def test_mlflow_nested_run_and_resume(sqlite_uri):
    from mlflow.tracking import MlflowClient

    uri = sqlite_uri
    parent = MLflowSink(uri, experiment="sweep", run_name="study")
    child = MLflowSink(uri, experiment="sweep", run_name="trial-0", parent_run_id=parent.run_id)
    child.log_params({"actor.clip_ratio": 0.2})
    child.log_metrics({"critic/score/mean": 0.1}, 0)
    child.close(status="KILLED")

    resumed = MLflowSink(uri, run_id=child.run_id)
    assert resumed.run_id == child.run_id
    with pytest.warns(UserWarning, match="actor.clip_ratio"):
        resumed.log_params({"actor.clip_ratio": 0.3, "actor.lr": 1e-5})
    resumed.log_metrics({"critic/score/mean": 0.2}, 1)
    resumed.close()
    parent.close()

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(child.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id
    assert run.data.params == {"actor.clip_ratio": "0.2", "actor.lr": "1e-05"}
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(child.run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.1), (1, 0.2)]


def test_mlflow_resume_of_unknown_run_raises(sqlite_uri):
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):
        MLflowSink(sqlite_uri, run_id="0123456789abcdef0123456789abcdef")


# ---------------------------------------------------------------------------------
# make_sink
# ---------------------------------------------------------------------------------


def test_make_sink_builds_console_and_mlflow_from_config(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = from_dict({"trainer": {"logger": ["console", "mlflow"], "output_dir": str(tmp_path / "out"),
                                 "project_name": "proj", "experiment_name": "exp-a"}})
    sink = make_sink(cfg.trainer.logger, cfg)
    assert isinstance(sink, MultiSink)
    console, mlflow_sink = sink.sinks
    assert isinstance(console, ConsoleSink) and isinstance(mlflow_sink, BufferedMLflowSink)
    sink.log_metrics({"critic/score/mean": 1.0}, 0)
    sink.close()

    db = tmp_path / "out" / "mlflow.db"
    assert db.is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = client.get_run(mlflow_sink.run_id)
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.info.run_name == "exp-a"
    assert run.data.params["trainer.experiment_name"] == "exp-a"
    assert run.data.metrics == {"critic/score/mean": 1.0}


def test_make_sink_none_unknown_and_single():
    cfg = PPOConfig()
    assert isinstance(make_sink(["none"], cfg), NullSink)
    assert isinstance(make_sink([], cfg), NullSink)
    assert isinstance(make_sink(["console", "console"], cfg), ConsoleSink)
    with pytest.raises(ValueError, match="tensorboard"):
        make_sink(["tensorboard"], cfg)


# ---------------------------------------------------------------------------------
# A real MLflow tracking server over HTTP
# ---------------------------------------------------------------------------------


def test_mlflow_http_server_roundtrip(mlflow_server, artifact):
    from mlflow.tracking import MlflowClient

    cfg = PPOConfig()
    sink = MLflowSink(mlflow_server, experiment=f"http-{uuid.uuid4().hex[:8]}", run_name="over-http")
    _log_run(sink, cfg, artifact)
    _check_run(MlflowClient(tracking_uri=mlflow_server), sink.run_id, cfg)


# ---------------------------------------------------------------------------------
# Weights & Biases, offline
# ---------------------------------------------------------------------------------


def test_wandb_offline_run(tmp_path, monkeypatch):
    from rlhf.tracking.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    sink = WandbSink("proj", "run", {"actor.clip_ratio": 0.2}, output_dir=str(tmp_path))
    sink.log_metrics({"critic/score/mean": 0.5, "actor/ppo_kl": float("inf")}, 0)
    sink.log_metrics({"critic/score/mean": 0.7}, 1)
    summary = dict(sink.run.summary)
    sink.close()
    assert summary["critic/score/mean"] == 0.7
    assert any((tmp_path / "wandb").iterdir())


def test_buffered_records_leave_with_the_task_and_the_next_task_sends_them(sqlite_uri, tmp_path, monkeypatch):
    """A task whose MLflow server is down keeps its records in the state it returns
    (`keep_pending`); the next task, in another pod (another buffer directory), sends them
    into the same run once its server answers."""
    import socket

    from mlflow.tracking import MlflowClient

    from rlhf.train import setup as P
    from rlhf.config import load_config
    from rlhf.round.state import RoundState

    run_id = MlflowClient(sqlite_uri).create_run(
        MlflowClient(sqlite_uri).create_experiment(f"carry-{tmp_path.name}")).info.run_id
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    pod_a = load_config(None, ["trainer.logger=[mlflow]", f"trainer.mlflow_tracking_uri={down}",
                               f"trainer.output_dir={tmp_path / 'pod_a'}"])
    sink = P.tracking_sink(pod_a, run_id, RoundState())
    sink.log_metrics({"actor/pg_loss": 0.5}, step=1)
    sink.log_metrics({"actor/pg_loss": 0.25}, step=2)
    state = P.keep_pending(sink, RoundState(round=1))
    assert state.round == 1 and len([r for r in state.tracking_pending if '"metrics"' in r]) == 2

    pod_b = load_config(None, ["trainer.logger=[mlflow]", f"trainer.mlflow_tracking_uri={sqlite_uri}",
                               f"trainer.output_dir={tmp_path / 'pod_b'}"])
    sink_b = P.tracking_sink(pod_b, run_id, state)
    history = MlflowClient(sqlite_uri).get_metric_history(run_id, "actor/pg_loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.5), (2, 0.25)]
    assert P.keep_pending(sink_b, state).tracking_pending == []


def test_wandb_tasks_of_one_execution_log_into_one_run(tmp_path, monkeypatch):
    from rlhf.tracking.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    first = WandbSink("proj", "run", output_dir=str(tmp_path), run_id="execution0001")
    first.close()
    second = WandbSink("proj", "run", output_dir=str(tmp_path), run_id="execution0001")
    assert first.run.id == second.run.id == "execution0001"
    second.close()
    assert WandbSink("proj", "run", output_dir=str(tmp_path)).run.id != "execution0001"
