"""`BufferedMLflowSink`: an MLflow run that training never waits on or fails through.

While the tracking server does not answer, every call is buffered in a local JSON-lines
file and sent when the server is back (or by the next run in the same output directory).
`rlhf.tracking.make.make_sink` builds it for "mlflow".
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from rlhf.config.redact import redact
from rlhf.tracking.sinks import (
    METRICS_PER_BATCH,
    MLflowSink,
    _chunks,
    _log,
    clean_metrics,
    default_tracking_uri,
    mlflow_key,
    param_value,
)


class BufferedMLflowSink:
    """An MLflow run that training never waits on or fails through.

    Every call goes straight to an `MLflowSink` while the server answers. When it does not
    (unreachable at start, gone mid-run), the call is appended to `<buffer_dir>/pending.jsonl`
    with a warning, and at most every `retry_s` seconds the buffer is sent again, oldest
    first; the run itself is created once the server is reachable. Records still buffered
    at `close()` are sent by the next sink opened on the same `buffer_dir` (the next run in
    the same output directory). Metrics keep their original timestamp, so a record sent
    twice (a request that reached the server but whose answer was lost) is stored once;
    params and tags are idempotent. HTTP requests run with short retries and timeout
    (`MLFLOW_HTTP_REQUEST_MAX_RETRIES`, `MLFLOW_HTTP_REQUEST_TIMEOUT`, unless set).
    Sinks of one process may share a buffer directory; processes should not (rank 0 logs)."""

    PENDING = "pending.jsonl"
    RUNS = "runs.json"  # buffer key -> what is needed to create or resume its MLflow run

    def __init__(self, buffer_dir: str, tracking_uri: str = "", experiment: str = "default",
                 run_name: str | None = None, run_id: str | None = None, parent_run_id: str | None = None,
                 tags: dict[str, Any] | None = None, output_dir: str = "outputs", retry_s: float = 30.0):
        import uuid

        self.dir = os.path.abspath(buffer_dir)
        os.makedirs(self.dir, exist_ok=True)
        self.retry_s = retry_s
        self.key = uuid.uuid4().hex
        self._runs = self._read_runs()
        # The URI as given ("" => resolved from the environment when sending): a URI from
        # $MLFLOW_TRACKING_URI may carry credentials, which must not be written here.
        self._set_run(self.key, {"tracking_uri": tracking_uri,
                                 "experiment": experiment, "run_name": run_name, "run_id": run_id or "",
                                 "parent_run_id": parent_run_id,
                                 "tags": {k: str(v) for k, v in (tags or {}).items()}, "output_dir": output_dir})
        self._sinks: dict[str, MLflowSink] = {}
        self._next_try = 0.0
        self._down_since: float | None = None
        self._closed = False
        self._flush(force=True)  # what an earlier run left, then this run is created
        self._connect(self.key)

    @property
    def run_id(self) -> str:
        """The MLflow run id, "" while the run could not be created yet."""
        return self._runs[self.key]["run_id"]

    @property
    def pending_path(self) -> str:
        return os.path.join(self.dir, self.PENDING)

    # -- the Sink protocol ------------------------------------------------------------------
    def log_params(self, params: dict[str, Any]) -> None:
        self._submit({"op": "params", "params": {mlflow_key(k): param_value(v) for k, v in params.items()}})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._submit({"op": "metrics", "metrics": clean_metrics(metrics), "step": int(step),
                      "ts": int(time.time() * 1000)})

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        self._submit({"op": "artifact", "path": os.path.abspath(path), "artifact_path": artifact_path})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._submit({"op": "tags", "tags": {k: redact(str(v)) for k, v in tags.items()}})

    def close(self, status: str = "FINISHED") -> None:
        """End the run; a final attempt sends what is buffered, the rest waits for the next run."""
        if self._closed:
            return
        self._closed = True
        self._submit({"op": "close", "status": status})
        self._flush(force=True)
        left = len(self._pending())
        if left:
            _log.warning("MLflow at %s still unreachable at the end of the run: %d records kept in %s; the "
                         "next run with the same output directory sends them", self._where(self.key),
                         left, self.pending_path)

    # -- carrying the buffer to another process ------------------------------------------------
    def export_pending(self) -> list[str]:
        """This run's records not sent yet, as JSON lines, for a process that cannot keep the
        buffer directory (a Flyte pod): the next task's sink takes them (`import_pending`)."""
        return [json.dumps({k: v for k, v in r.items() if k != "run"}) for r in self._pending()
                if r.get("run") == self.key]

    def import_pending(self, records: list[str]) -> None:
        """Records an earlier process of the same MLflow run exported: buffered ahead of this
        sink's own and sent now if the server answers (a record sent twice is stored once)."""
        if not records:
            return
        for line in records:
            self._append({**json.loads(line), "run": self.key})
        self._flush(force=True)

    # -- sending and buffering --------------------------------------------------------------
    def _submit(self, rec: dict) -> None:
        rec["run"] = self.key
        if self._down_since is None and not any(r.get("run") == self.key for r in self._pending()):
            try:
                self._apply(rec)
                return
            except Exception as e:  # nothing about training depends on the tracker
                self._went_down(e)
        self._append(rec)
        self._flush()

    def _flush(self, force: bool = False) -> None:
        """Send the buffer, oldest first; a run whose record fails keeps it and all its later
        ones (in order), without holding back other runs' records (another server, say)."""
        if not force and time.monotonic() < self._next_try:
            return
        records = self._pending()
        kept, failed = [], {}
        for rec in records:
            if rec.get("run") not in failed:
                try:
                    self._apply(rec)
                    continue
                except Exception as e:
                    failed[rec.get("run")] = e
            kept.append(rec)
        if len(kept) < len(records):
            self._rewrite(kept)
            _log.warning("MLflow: sent %d buffered records from %s%s", len(records) - len(kept), self.pending_path,
                         f"; {len(kept)} kept for a later attempt" if kept else "")
        for key, e in failed.items():
            if key != self.key:
                _log.warning("buffered MLflow records of an earlier run (%s) could not be sent: %s",
                             self._where(key), redact(str(e).splitlines()[0][:300]))
        if self.key in failed:
            self._went_down(failed[self.key])
        else:
            self._down_since = None

    def _went_down(self, e: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            _log.warning("MLflow at %s is unreachable (%s: %s); training goes on and metrics are buffered in %s "
                         "until it answers again (retried every %.0f s)", self._where(self.key),
                         type(e).__name__, redact(str(e).splitlines()[0][:300]) if str(e) else "", self.pending_path,
                         self.retry_s)
        self._next_try = time.monotonic() + self.retry_s

    def _where(self, key: str) -> str:
        """The tracking URI of buffer key `key`, for messages (credentials redacted)."""
        spec = self._runs.get(key)
        return redact(default_tracking_uri(spec["tracking_uri"], spec["output_dir"])) if spec else "?"

    def _connect(self, key: str) -> "MLflowSink | None":
        try:
            return self._sink(key)
        except Exception as e:
            self._went_down(e)
            return None

    def _sink(self, key: str) -> "MLflowSink":
        """The `MLflowSink` of buffer key `key`: its run resumed, or created (and remembered)."""
        if key not in self._sinks:
            spec = dict(self._runs[key])
            with _short_http_requests():
                sink = MLflowSink(spec["tracking_uri"], spec["experiment"], spec["run_name"],
                                  run_id=spec["run_id"] or None, parent_run_id=spec["parent_run_id"],
                                  tags=spec["tags"], output_dir=spec["output_dir"])
            if not spec["run_id"]:
                spec["run_id"] = sink.run_id
                self._set_run(key, spec)
            self._sinks[key] = sink
        return self._sinks[key]

    def _apply(self, rec: dict) -> None:
        from mlflow.entities import Metric

        if rec["run"] not in self._runs:
            self._runs = {**self._read_runs(), **self._runs}  # a run opened by another sink meanwhile
        if rec["run"] not in self._runs:
            _log.warning("dropping a buffered MLflow record of an unknown run (%s)", rec.get("op"))
            return
        sink = self._sink(rec["run"])
        with _short_http_requests():
            op = rec["op"]
            if op == "metrics":
                batch = [Metric(k, math.nan if v is None else v, rec["ts"], rec["step"])
                         for k, v in ((mlflow_key(k), v) for k, v in rec["metrics"].items())]
                for chunk in _chunks(batch, METRICS_PER_BATCH):
                    sink.client.log_batch(sink.run_id, metrics=chunk)
            elif op == "params":
                sink.log_params(rec["params"])
            elif op == "tags":
                sink.set_tags(rec["tags"])
            elif op == "artifact":
                if os.path.exists(rec["path"]):
                    sink.log_artifact(rec["path"], rec["artifact_path"])
                else:
                    _log.warning("buffered MLflow artifact %s no longer exists; not sent", rec["path"])
            elif op == "close":
                sink.close(rec["status"])
                self._drop_run(rec["run"])

    # -- the files ----------------------------------------------------------------------------
    def _pending(self) -> list[dict]:
        try:
            with open(self.pending_path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for i, line in enumerate(lines):
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut short by a crash while it was appended
                _log.warning("skipping unreadable line %d of %s", i + 1, self.pending_path)
        return out

    def _append(self, rec: dict) -> None:
        with open(self.pending_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _rewrite(self, records: list[dict]) -> None:
        if not records:
            if os.path.exists(self.pending_path):
                os.remove(self.pending_path)
            return
        _write_atomic(self.pending_path, "".join(json.dumps(r) + "\n" for r in records))

    def _read_runs(self) -> dict[str, dict]:
        path = os.path.join(self.dir, self.RUNS)
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return {}
        except ValueError as e:
            _log.warning("ignoring unreadable %s (%s)", path, e)
            return {}

    def _set_run(self, key: str, spec: dict) -> None:
        """Record run `key` in memory and on disk (merged with what other sinks wrote there)."""
        self._runs[key] = spec
        on_disk = self._read_runs()
        on_disk[key] = spec
        _write_atomic(os.path.join(self.dir, self.RUNS), json.dumps(on_disk, indent=1))

    def _drop_run(self, key: str) -> None:
        """Forget a run on disk once it is closed (its records are all sent)."""
        on_disk = self._read_runs()
        if on_disk.pop(key, None) is not None:
            _write_atomic(os.path.join(self.dir, self.RUNS), json.dumps(on_disk, indent=1))


_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class _short_http_requests:
    """MLflow's HTTP defaults retry a failed request for minutes; the buffered sink retries
    by itself, so its requests fail fast unless the user set these variables."""

    def __enter__(self) -> None:
        self.added = [k for k in _HTTP_DEFAULTS if k not in os.environ]
        for k in self.added:
            os.environ[k] = _HTTP_DEFAULTS[k]

    def __exit__(self, *exc) -> None:
        for k in self.added:
            os.environ.pop(k, None)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
