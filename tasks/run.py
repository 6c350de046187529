"""The run's frame: config check, tracking, the rounds' end, and the report with its decks."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd
from flytekit import Deck, task

from containers.images import CPU_IMAGE
from rlhf import pipeline as P
from rlhf.config import PPOConfig, derive_sizes, replace
from rlhf.plots import training_html
from rlhf.state import RoundState
from tasks.base import CPU_SMALL, DECK, DECK_FIELDS, TRACKING_SECRETS, retry_transient

@task(requests=CPU_SMALL, container_image=CPU_IMAGE)
def check_config(cfg: PPOConfig) -> PPOConfig:
    """The config, checked before any work starts: value ranges and choices, and batch sizes
    that divide (`derive_sizes`); a `ConfigError` names the key and what to change."""
    checked = replace(cfg, [])
    derive_sizes(checked)
    return checked


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def start_tracking(cfg: PPOConfig) -> str:
    """Open the run's MLflow run when `trainer.logger` lists mlflow; returns its id ("" without)."""
    with retry_transient():
        return P.open_tracking(cfg)


def resume_point(cfg: PPOConfig) -> Optional[tuple[str, RoundState]]:
    """Where a new execution starts when `trainer.resume` names a checkpoint (a local path or
    a URI): that checkpoint and the round state saved in it, read here so that the workflow
    can lay out the rounds left. None for "auto" and "disable" (a new execution starts from
    the base policy; retries of a segment resume from its intratask checkpoint either way)."""
    where = cfg.trainer.resume
    if where in ("auto", "disable"):
        return None
    from flytekit import FlyteContextManager

    from rlhf.checkpoint import STATE_FILE

    fa = FlyteContextManager.current_context().file_access
    local = Path(fa.get_random_local_directory()) / STATE_FILE
    with retry_transient():
        fa.get_data(f"{where.rstrip('/')}/{STATE_FILE}", str(local))
    return where, RoundState.from_json(local.read_text())


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, enable_deck=True, deck_fields=DECK_FIELDS,
      retries=2, secret_requests=TRACKING_SECRETS)
def report(cfg: PPOConfig, state: RoundState, run_id: str) -> pd.DataFrame:
    """The metrics table (one row per step, val scores merged), the final deck with the stop
    reason, and the summary in the tracker (the MLflow run is closed here)."""
    reason = P.stop_reason(cfg, state)
    Deck(DECK, training_html(state, reason))
    table = P.metrics_table(state)
    Deck("metrics table", table.to_html(index=False, float_format=lambda x: f"{x:.5g}"))
    sink = P.tracking_sink(cfg, run_id, state)
    summary = P.summary(cfg, state)
    with retry_transient():
        sink.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))}, step=state.global_step)
        sink.set_tags({"stop_reason": reason})
        sink.close()
    return table
