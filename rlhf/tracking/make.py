"""The sinks a config names (`trainer.logger`), built from it."""

from __future__ import annotations

import os
from typing import Any, Iterable

from rlhf.config.schema import flatten
from rlhf.tracking.buffer import BufferedMLflowSink
from rlhf.tracking.sinks import ConsoleSink, MultiSink, NullSink, Sink, WandbSink


def make_sink(names: Iterable[str], cfg, run_name: str | None = None, run_id: str | None = None,
              parent_run_id: str | None = None, wandb_id: str | None = None,
              tags: dict[str, Any] | None = None) -> Sink:
    """Sinks for `names` (trainer.logger: "console", "mlflow", "wandb", "none") from a PPOConfig.

    MLflow: experiment `trainer.project_name`, run name `run_name` or `trainer.experiment_name`
    (verl's mapping), buffered in `<output_dir>/mlflow_buffer` while the server does not answer
    (`BufferedMLflowSink`), tracking URI `trainer.mlflow_tracking_uri` / $MLFLOW_TRACKING_URI / SQLite
    in `trainer.output_dir`; the flattened config is logged as params. `run_id` resumes a run.
    wandb: `wandb_id` resumes (or creates) the run of that id.
    """
    t = cfg.trainer
    name = run_name or t.experiment_name
    sinks: list[Sink] = []
    for kind in dict.fromkeys(names):  # de-duplicated, order kept
        if kind == "console":
            sinks.append(ConsoleSink())
        elif kind == "mlflow":
            sink = BufferedMLflowSink(os.path.join(t.output_dir, "mlflow_buffer"), t.mlflow_tracking_uri,
                                      t.project_name, name, run_id=run_id, parent_run_id=parent_run_id,
                                      tags=tags, output_dir=t.output_dir)
            sink.log_params(flatten(cfg))
            sinks.append(sink)
        elif kind == "wandb":
            sinks.append(WandbSink(t.project_name, name, flatten(cfg), output_dir=t.output_dir, run_id=wandb_id))
        elif kind != "none":
            raise ValueError(f"trainer.logger entry {kind!r} is unknown; choose from console, mlflow, wandb, none")
    if not sinks:
        return NullSink()
    return sinks[0] if len(sinks) == 1 else MultiSink(sinks)
