"""The run's frame: config check, tracking, the rounds' end, and the report with its decks."""

from __future__ import annotations

from typing import NamedTuple

import pandas as pd
from flytekit import Deck, task
from flytekit.types.directory import FlyteDirectory

from containers.images import CPU_IMAGE
from rlhf import pipeline as P
from rlhf.config import PPOConfig, derive_sizes, replace
from rlhf.plots import training_html
from rlhf.state import RoundState
from tasks.base import CPU_SMALL, DECK, DECK_FIELDS, TRACKING_SECRETS, retry_transient

Finished = NamedTuple("Finished", [("model", FlyteDirectory), ("state", RoundState)])


@task(requests=CPU_SMALL, container_image=CPU_IMAGE)
def check_config(cfg: PPOConfig) -> PPOConfig:
    """The config, checked before any work starts: value ranges and choices, batch sizes
    that divide (`derive_sizes`), local data files, model directories and the position limit
    (`rlhf.check.preflight`); the error names the key, file or row and what to change."""
    from rlhf.check import preflight

    checked = replace(cfg, [])
    derive_sizes(checked)
    for warning in preflight(checked).warnings:
        print(f"warning: {warning}", flush=True)
    return checked


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def start_tracking(cfg: PPOConfig) -> str:
    """Open the run's MLflow run when `trainer.logger` lists mlflow; returns its id ("" without)."""
    with retry_transient():
        return P.open_tracking(cfg)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE)
def finish(model: FlyteDirectory, state: RoundState) -> Finished:
    """The rounds' end when `decide` stops early: the last policy and state, passed through."""
    return Finished(model=model, state=state)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, enable_deck=True, deck_fields=DECK_FIELDS,
      retries=2, secret_requests=TRACKING_SECRETS)
def report(cfg: PPOConfig, state: RoundState, run_id: str) -> pd.DataFrame:
    """The metrics table (one row per step, val scores merged), the final deck with the stop
    reason, and the summary in the tracker (the MLflow run is closed here)."""
    reason = P.stop_reason(cfg, state)
    Deck(DECK, training_html(state, reason))
    table = P.metrics_table(state)
    Deck("metrics table", table.to_html(index=False, float_format=lambda x: f"{x:.5g}"))
    sink = P.tracking_sink(cfg, run_id)
    summary = P.summary(cfg, state)
    with retry_transient():
        sink.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))}, step=state.global_step)
        sink.set_tags({"stop_reason": reason})
        sink.close()
    return table
