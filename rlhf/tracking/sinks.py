"""Where metrics go: one small `Sink` protocol and its implementations.

- `ConsoleSink`: one compact line per step with a few key metrics.
- `MLflowSink`: params, one `log_batch` call per step, tags, artifacts; nested runs
  (`parent_run_id`) and resuming a run (`run_id`). Only this sink imports mlflow.
- `BufferedMLflowSink` (`rlhf.tracking.buffer`): an `MLflowSink` that survives its
  server: while the server does not answer, calls are buffered in a local file and sent
  when it is back (or by the next run in the same output directory).
- `WandbSink`: imported only when "wandb" is listed; offline unless `WANDB_MODE` says otherwise.
- `NullSink`, `MultiSink`. `rlhf.tracking.make.make_sink(names, cfg)` builds the sinks
  `trainer.logger` names.

Non-finite metric values (NaN, +-inf) never crash a sink: every sink logs them as
NaN (`clean_metrics`), so a diverged step shows up as a NaN point at its step rather
than as a missing point or an exception in the training loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
import warnings
from typing import Any, Iterable, Protocol, TextIO, runtime_checkable

from rlhf.config.redact import SECRET_ENV_VARS, URI_PASSWORD, redact  # noqa: F401 (also read from this module)
from rlhf.tracking.progress import format_number

# Console line: (metric key, short label); val-core/* and val/* keys are appended as found.
# Labels are the metric names themselves, as the decks and MLflow show them.
CONSOLE_KEYS: tuple[tuple[str, str], ...] = tuple((k, k) for k in (
    "critic/score/mean", "actor/current_kl", "actor/pg_loss", "critic/vf_loss", "actor/entropy",
    "response_length/mean", "actor/reward_kl_penalty_coeff", "timing_s/step"))
_log = logging.getLogger(__name__)
PARAM_VALUE_MAX = 6000  # MLflow's limit on a param value
TAG_VALUE_MAX = 8000  # MLflow's limit on a tag value
PARAMS_PER_BATCH = 100  # MLflow's limit on params or tags per log_batch
METRICS_PER_BATCH = 1000  # MLflow's limit on metrics per log_batch


@runtime_checkable
class Sink(Protocol):
    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: dict[str, Any]) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...


# ---------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Values as floats (numpy/torch scalars included); NaN and +-inf become NaN."""
    out = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__} {value!r}") from e
        out[key] = number if math.isfinite(number) else math.nan
    return out


def mlflow_key(key: str) -> str:
    """A metric/param name MLflow accepts: "@" -> "_at_" (as verl does), other bad characters -> "_"."""
    key = key.replace("@", "_at_")
    return re.sub(r"[^/\w.\- :]", "_", key)[:250]


def param_value(value: Any) -> str:
    """A param value as MLflow stores it: str, lists/dicts as JSON, credentials redacted, cut to
    MLflow's length limit."""
    text = redact(json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value))
    return text if len(text) <= PARAM_VALUE_MAX else text[:PARAM_VALUE_MAX - 3] + "..."


def format_step(metrics: dict[str, float], step: int, keys: Iterable[tuple[str, str]] = CONSOLE_KEYS) -> str:
    """`step 3 | score 0.5 | kl 0.0012 | ... | val-core/x/reward/mean@1 0.8`: key metrics present in `metrics`."""
    parts = [f"step {step}"]
    parts += [f"{label} {format_number(metrics[key])}" for key, label in keys if key in metrics]
    parts += [f"{key} {format_number(v)}" for key, v in metrics.items() if key.startswith(("val-core/", "val/"))]
    return " | ".join(parts)


def default_tracking_uri(explicit: str = "", output_dir: str = "outputs") -> str:
    """`explicit`, else $MLFLOW_TRACKING_URI, else a SQLite store in `output_dir`."""
    uri = explicit or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri:
        return uri
    os.makedirs(output_dir, exist_ok=True)
    return f"sqlite:///{os.path.abspath(os.path.join(output_dir, 'mlflow.db'))}"


def local_artifact_location(tracking_uri: str) -> str | None:
    """Artifacts of a local SQLite store go beside the database (not into ./mlruns of the cwd)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db_path = tracking_uri[len("sqlite:///"):]
    return "file://" + os.path.join(os.path.dirname(os.path.abspath(db_path)), "mlartifacts")


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


# ---------------------------------------------------------------------------------
# Sinks
# ---------------------------------------------------------------------------------


class NullSink:
    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        pass

    def set_tags(self, tags: dict[str, Any]) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


class ConsoleSink(NullSink):
    """One line per step (see `format_step`), written to `stream` (stdout by default)."""

    def __init__(self, stream: TextIO | None = None, keys: Iterable[tuple[str, str]] = CONSOLE_KEYS):
        self.stream = stream
        self.keys = tuple(keys)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        stream = self.stream or sys.stdout
        print(format_step(clean_metrics(metrics), step, self.keys), file=stream, flush=True)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        print(f"artifact {path}", file=self.stream or sys.stdout, flush=True)


class MLflowSink:
    """An MLflow run: a new one in `experiment` (nested under `parent_run_id` when given),
    or the existing `run_id` resumed. `tracking_uri` "" => `default_tracking_uri`."""

    def __init__(self, tracking_uri: str = "", experiment: str = "default", run_name: str | None = None,
                 run_id: str | None = None, parent_run_id: str | None = None, tags: dict[str, Any] | None = None,
                 output_dir: str = "outputs"):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError("trainer.logger lists 'mlflow' but mlflow is not installed: pip install mlflow") from e
        self.tracking_uri = default_tracking_uri(tracking_uri, output_dir)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        if run_id:
            self.run_id = self._resume(run_id)
        else:
            self.run_id = self._create(experiment, run_name, parent_run_id, tags or {})
        self._closed = False

    def _create(self, experiment: str, run_name: str | None, parent_run_id: str | None, tags: dict) -> str:
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            exp_id = self.client.create_experiment(experiment, artifact_location=local_artifact_location(
                self.tracking_uri))
        else:
            exp_id = exp.experiment_id
        run_tags = {k: str(v) for k, v in tags.items()}
        if parent_run_id:
            run_tags["mlflow.parentRunId"] = parent_run_id
        return self.client.create_run(exp_id, run_name=run_name, tags=run_tags).info.run_id

    def _resume(self, run_id: str) -> str:
        run = self.client.get_run(run_id)  # raises if the run does not exist
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log_params(self, params: dict[str, Any]) -> None:
        """Params are write-once in MLflow: on a resumed run, already logged keys whose value
        changed are skipped with a warning (the first value stays)."""
        from mlflow.entities import Param

        new = {mlflow_key(k): param_value(v) for k, v in params.items()}
        old = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k in new if k in old and old[k] != new[k])
        if changed:
            warnings.warn(f"MLflow run {self.run_id} already has params {changed} with other values; "
                          "MLflow params cannot change, so the first values are kept", stacklevel=2)
        todo = [Param(k, v) for k, v in new.items() if k not in old]
        for chunk in _chunks(todo, PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """The whole step in one request (several only beyond 1000 metrics)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, int(step)) for k, v in clean_metrics(metrics).items()]
        for chunk in _chunks(batch, METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if os.path.isdir(path):
            self.client.log_artifacts(self.run_id, path, artifact_path)
        else:
            self.client.log_artifact(self.run_id, path, artifact_path)

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        batch = [RunTag(mlflow_key(k), redact(str(v))[:TAG_VALUE_MAX]) for k, v in tags.items()]
        for chunk in _chunks(batch, PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=chunk)

    def close(self, status: str = "FINISHED") -> None:
        """End the run ("FINISHED", "FAILED" or "KILLED"); later calls do nothing. MLflow prints a
        link to the run, built from the tracking URI: not when that URI carries a password."""
        if not self._closed:
            quiet = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"} if URI_PASSWORD.search(self.tracking_uri) else {}
            with _environment(quiet):
                self.client.set_terminated(self.run_id, status=status)
            self._closed = True


class _environment:
    """Environment variables set for the duration of a `with` block (then restored)."""

    def __init__(self, values: dict[str, str]):
        self.values = values

    def __enter__(self) -> None:
        self.before = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc) -> None:
        for k, v in self.before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class WandbSink:
    """A Weights & Biases run; `mode` None => $WANDB_MODE, else "offline" (no network needed)."""

    def __init__(self, project: str, run_name: str | None = None, config: dict[str, Any] | None = None,
                 output_dir: str = "outputs", mode: str | None = None, run_id: str | None = None):
        """`run_id`: the run to resume or create under that id (`resume="allow"`), so that the
        tasks of one execution log into one run; None => a new run."""
        try:
            import wandb
        except ImportError as e:
            raise ImportError("trainer.logger lists 'wandb' but wandb is not installed: pip install wandb") from e
        os.makedirs(output_dir, exist_ok=True)
        resume = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(project=project, name=run_name, config=config or {}, dir=output_dir,
                              mode=mode or os.environ.get("WANDB_MODE", "offline"), **resume)

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # commit=True: with an explicit step wandb holds the row back until the next step
        # arrives, so the run's summary (and a live dashboard) would lag one step behind.
        self.run.log(clean_metrics(metrics), step=int(step), commit=True)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self.run.save(path, base_path=os.path.dirname(os.path.abspath(path)), policy="now")

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.run.tags = tuple(self.run.tags or ()) + tuple(f"{k}:{v}" for k, v in tags.items())

    def close(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class MultiSink:
    """Forwards every call to each sink, in order."""

    def __init__(self, sinks: Iterable[Sink]):
        self.sinks = list(sinks)

    def log_params(self, params: dict[str, Any]) -> None:
        for s in self.sinks:
            s.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for s in self.sinks:
            s.log_metrics(metrics, step)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        for s in self.sinks:
            s.log_artifact(path, artifact_path)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for s in self.sinks:
            s.set_tags(tags)

    def close(self, status: str = "FINISHED") -> None:
        for s in self.sinks:
            s.close(status)
