"""The run's frame: config check, tracking, the rounds' end, the merged final policy, and the
report with its decks."""

from __future__ import annotations

import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Optional, Union

import pandas as pd
from flytekit import Deck, dynamic, task
from flytekit.core.context_manager import FlyteContextManager
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError

from containers.images import CPU_IMAGE
from rlhf.checkpoint import rounds as ckpt
from rlhf.checkpoint.adapters import save_merged
from rlhf.config.verl_defaults import defaults_line
from rlhf.train import stateless as P
from rlhf.train.check import CheckFailed, preflight
from rlhf.tracking.progress import quiet_progress_bars
from rlhf.tracking.status import LAUNCH_TAG, fail_launch_runs, launch_key
from rlhf.train import setup as S
from rlhf.train.report import end_summary, publish
from rlhf.config.load import load_config, replace
from rlhf.config.redact import redact
from rlhf.config.schema import ConfigError, PPOConfig
from rlhf.config.sizes import derive_sizes
from rlhf.models.load import LoraSetupError, is_adapter_dir, load_options
from rlhf.tracking.plots import training_html
from rlhf.tracking.results import summary_rows, summary_table
from rlhf.round.state import RoundState
from tasks.base import (CPU_LARGE, CPU_SMALL, DECK, DECK_FIELDS, TRACKING_SECRETS, TRANSIENT, LaunchError,
                        launch_seconds, local_copy, retry_transient, workdir)
from tasks.registry import registry_uri

log = logging.getLogger(__name__)


LaunchConfig = Optional[Union[PPOConfig, str]]  # a launch's config: given, the defaults (None), or a file's path


def launch_config(cfg: LaunchConfig) -> PPOConfig:
    """The config of a launch: the one given, the defaults for none, or the one in the file a path
    names (what `pyflyte run ... --cfg FILE` passes on when it cannot decode the file itself)."""
    if cfg is None:
        return PPOConfig()
    return load_config(cfg) if isinstance(cfg, str) else cfg


@task(requests=CPU_SMALL, container_image=CPU_IMAGE)
def check_config(cfg: LaunchConfig = None) -> PPOConfig:
    """The config (`launch_config`), checked before any work starts: value ranges and choices,
    batch sizes that divide (`derive_sizes`), local data files, model directories and the
    position limit (`rlhf.train.check.preflight`); the error (`LaunchError`, one line under
    `pyflyte run`) names every key, file or row found wrong and what to change."""

    quiet_progress_bars()  # in a local execution, for the whole launch: no bars between the round lines
    try:
        checked = replace(launch_config(cfg), [])
        print(defaults_line(checked), flush=True)  # before the checks: it explains values they may refuse
        derive_sizes(checked)
        plan = preflight(checked)
    except (ConfigError, CheckFailed) as e:
        raise LaunchError(str(e)) from None
    for warning in plan.warnings:
        print(f"warning: {warning}", flush=True)
    return checked


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def start_tracking(cfg: PPOConfig) -> str:
    """Open the run's MLflow run when `trainer.logger` lists mlflow; returns its id ("" without)."""
    with retry_transient():
        return S.open_tracking(cfg, tags={LAUNCH_TAG: launch()})


def launch() -> str:
    """This launch's key for `rlhf.tracking.status` (the Flyte execution; plus host and process locally)."""
    from flytekit import current_context

    state = FlyteContextManager.current_context().execution_state
    local = state is None or state.is_local_execution()
    e = current_context().execution_id
    return launch_key(e.project, e.domain, e.name, local)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def fail_tracking(cfg: LaunchConfig = None, err: Optional[FlyteError] = None) -> None:
    """The failure handler of a launch: its MLflow run, if one was opened, ends as FAILED."""
    try:
        cfg = launch_config(cfg)
    except ConfigError:  # the launch failed on its config: no run was opened
        return
    _fail_runs(cfg, err)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def fail_retrain_tracking(cfg: PPOConfig, train_files: str, val_files: str, model_name: str, run_date: datetime,
                          err: Optional[FlyteError] = None) -> None:
    """`fail_tracking` for the retraining workflow (a failure handler takes all workflow inputs)."""
    del train_files, val_files, model_name, run_date
    _fail_runs(cfg, err)


def _fail_runs(cfg: PPOConfig, err: Optional[FlyteError]) -> None:
    if "mlflow" not in cfg.trainer.logger:
        return
    with retry_transient():
        failed = fail_launch_runs(registry_uri(cfg), cfg.trainer.project_name, launch(), err.message if err else "")
    for run_id in failed:
        print(f"MLflow run {run_id} ended as FAILED", flush=True)


def resume_point(cfg: PPOConfig) -> Optional[tuple[str, RoundState]]:
    """Where a new execution starts when `trainer.resume` names a checkpoint (a local path or
    a URI): that checkpoint and the round state saved in it, read here so that the workflow
    can lay out the rounds left (`state.json` checked against the checkpoint's manifest first;
    the other files are checked by the first task that uses them, before it does). None for
    "auto" and "disable" (a new execution starts from the base policy; retries of a segment
    resume from its intratask checkpoint either way)."""
    where = cfg.trainer.resume
    if where in ("auto", "disable"):
        return None
    from flytekit import FlyteContextManager

    fa = FlyteContextManager.current_context().file_access
    local = Path(fa.get_random_local_directory())
    with retry_transient():
        for name in (ckpt.MANIFEST_FILE, ckpt.STATE_FILE):
            _fetch(fa, f"{where.rstrip('/')}/{name}", local / name)
    reason = ckpt.why_incomplete(local, part=ckpt.STATE_FILE)
    if reason:
        raise LaunchError(f"trainer.resume={where!r} is not a checkpoint to start from: {reason}; give a sealed "
                          "round checkpoint (<output_dir>/checkpoints/round_NNNNNN, or a checkpoint output of an "
                          "earlier execution), or trainer.resume=disable")
    return where, RoundState.from_json((local / ckpt.STATE_FILE).read_text())


def _fetch(fa, src: str, dest: Path) -> None:
    """Download one file; one that is not there is left missing (the check after names it)."""
    try:
        fa.get_data(src, str(dest))
    except TRANSIENT:
        raise
    except Exception as e:  # flytekit wraps a missing source in its own download error
        log.info("could not download %s: %s", src, e)


# What to do about a final policy whose adapters belong to another base than the run's.
MERGE_FIX = ("give the base model they were trained on (the model.path of the run that wrote them), or set "
             "trainer.save_merged=false to keep the adapter directory")


def _merges(cfg: PPOConfig) -> bool:
    return cfg.model.lora_rank > 0 and cfg.trainer.save_merged


@dynamic(requests=CPU_SMALL, container_image=CPU_IMAGE)
def final_policy(cfg: PPOConfig, base_model: FlyteDirectory, policy: FlyteDirectory) -> FlyteDirectory:
    """`policy`, or with LoRA and `trainer.save_merged` the `merge_policy` task's merged model:
    the large pod a whole model needs is asked for only when there is something to merge."""
    if not _merges(cfg):
        return policy
    return merge_policy(cfg=cfg, base_model=base_model, policy=policy)


@task(requests=CPU_LARGE, container_image=CPU_IMAGE, retries=2)
def merge_policy(cfg: PPOConfig, base_model: FlyteDirectory, policy: FlyteDirectory) -> FlyteDirectory:
    """The run's final policy for serving. With LoRA (`model.lora_rank` > 0) and
    `trainer.save_merged`, the adapters in `policy` (a LoRA checkpoint's `actor/`) merged into
    `base_model`, which must be the base they were trained on (the digests in their
    `base_model.json`), as a plain model directory; otherwise, or when `policy` holds plain
    weights already, `policy` itself (nothing copied)."""
    if not _merges(cfg):
        return policy
    with retry_transient():
        adapters, base = local_copy(policy), local_copy(base_model)
    if not is_adapter_dir(adapters):
        return policy
    try:
        out = save_merged(adapters, base, str(Path(workdir("merged_policy")) / "actor"), cfg.model.dtype,
                          fix=MERGE_FIX, **load_options(cfg.model))
    except LoraSetupError as e:  # named by their sources: the paths in `e` are local copies of remote ones
        sources = tuple(str(d.remote_source or d.path) for d in (policy, base_model))
        named = "" if sources == (adapters, base) else f" (final policy {sources[0]}, base model {sources[1]})"
        raise LoraSetupError(f"trainer.save_merged{named}: {e}") from None
    return FlyteDirectory(path=out)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, enable_deck=True, deck_fields=DECK_FIELDS,
      retries=2, secret_requests=TRACKING_SECRETS)
def report(cfg: PPOConfig, state: RoundState, run_id: str, model: Optional[FlyteDirectory] = None) -> pd.DataFrame:
    """The metrics table (one row per step, val scores merged), the final deck with the stop
    reason, the summary, config, curves and final policy reference in the tracker (the MLflow
    run is closed here), and the end-of-run table on the console."""
    reason = P.stop_reason(cfg, state)
    Deck(DECK, training_html(state, reason))
    table = P.metrics_table(state)
    Deck("metrics table", table.to_html(index=False, float_format=lambda x: f"{x:.5g}"))
    sink = S.tracking_sink(cfg, run_id, state)
    wall = launch_seconds()
    summary = end_summary(cfg, state, **({} if wall is None else {"wall_s": wall}),
                          world_size=cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)
    policy = (getattr(model, "remote_source", None) or model.path) if model is not None else ""
    with retry_transient():
        publish(sink, cfg, state, summary, str(policy), cfg.trainer.output_dir)
        sink.close()
    print_results(cfg, summary, str(policy), run_id)
    return table


def print_results(cfg: PPOConfig, summary: dict, policy: str, run_id: str) -> None:
    """The end-of-run table: scores, stop reason, wall time (the summary's), and where outputs,
    policy, decks and the MLflow run are (flytekit's deck files lie under its local sandbox in
    a local execution)."""
    ctx = FlyteContextManager.current_context()
    out = os.path.abspath(cfg.trainer.output_dir)
    where = {"outputs": out, "final policy": policy,
             "decks": f"{out}/run_artifacts/training.html; flytekit's deck.html files under "
                      f"{ctx.file_access.local_sandbox_dir}",
             "MLflow run": f"{run_id} at {redact(registry_uri(cfg))}" if run_id else ""}
    print(summary_table(summary_rows(summary, where)), flush=True)
