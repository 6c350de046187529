"""The files a tracked run keeps beside its metrics: config, curves, final policy, generations.

    config/config.yaml           the full PPOConfig of the run
    plots/training.html|.png     the training curves (the deck's figure)
    final_policy.json            where the final policy directory is (path or URI), its round and step
    generations/val_step_<N>.json  a few validation prompts, responses and scores per evaluation,
                                 in `mlflow.log_table`'s layout ({"columns": [...], "data": [...]})

The files are written under `<output_dir>/run_artifacts/` (they stay there, so that a sink
that buffers while its server is away can send them later) and handed to the sink's
`log_artifact`, so every sink gets them: MLflow as run artifacts, the console as a line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from rlhf.tracking.results import json_safe, write_text_atomic
from rlhf.config.load import save_config
from rlhf.tracking.plots import figure_png, training_figure, training_html

GENERATIONS_PER_EVAL = 8  # rows of the generations table per evaluation
GENERATION_COLUMNS = ("step", "data_source", "prompt", "response", "ground_truth", "score")


def artifact_dir(output_dir: str | os.PathLike) -> Path:
    path = Path(output_dir) / "run_artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_config(sink, cfg, output_dir: str | os.PathLike) -> None:
    """The run's config as `config/config.yaml`."""
    path = artifact_dir(output_dir) / "config.yaml"
    save_config(cfg, path)
    sink.log_artifact(str(path), "config")


def log_curves(sink, state, stop_reason: str, output_dir: str | os.PathLike) -> None:
    """The training curves as `plots/training.html` (the deck's view) and `plots/training.png`."""
    out = artifact_dir(output_dir)
    html_path = write_text_atomic(out / "training.html", training_html(state, stop_reason))
    png_path = out / "training.png"
    png_path.write_bytes(figure_png(training_figure(state, stop_reason)))
    sink.log_artifact(str(html_path), "plots")
    sink.log_artifact(str(png_path), "plots")


def log_final_policy(sink, policy: str, state, output_dir: str | os.PathLike) -> dict:
    """`final_policy.json`: the final policy's path or URI, with the round and step it is from."""
    ref = {"policy": str(policy), "round": state.round, "global_step": state.global_step,
           "val_score": state.last_val if state.last_val >= 0 else None}
    path = write_text_atomic(artifact_dir(output_dir) / "final_policy.json", json.dumps(ref, indent=2) + "\n")
    sink.log_artifact(str(path))
    return ref


def generations_table(step: int, samples: Sequence[dict[str, Any]], n: int = GENERATIONS_PER_EVAL) -> dict:
    """The first `n` samples (dicts with `GENERATION_COLUMNS` minus step) as a log_table layout."""
    rows = [[step] + [samples[i].get(c) for c in GENERATION_COLUMNS[1:]] for i in range(min(n, len(samples)))]
    return {"columns": list(GENERATION_COLUMNS), "data": json_safe(rows)}


def log_generations(sink, step: int, samples: Sequence[dict[str, Any]], output_dir: str | os.PathLike) -> None:
    """`generations/val_step_<step>.json`: a few prompts, responses and scores of one evaluation."""
    if not samples:
        return
    table = generations_table(step, samples)
    path = write_text_atomic(artifact_dir(output_dir) / f"val_step_{int(step):06d}.json",
                             json.dumps(table, indent=1, allow_nan=False) + "\n")
    sink.log_artifact(str(path), "generations")


def log_results(sink, cfg, state, stop_reason: str, policy: str, output_dir: str | os.PathLike) -> dict:
    """Config, curves and the final policy reference in one call, at the end of a run."""
    log_config(sink, cfg, output_dir)
    log_curves(sink, state, stop_reason, output_dir)
    return log_final_policy(sink, policy, state, output_dir)
