"""Model-registry tasks (MLflow): register a policy, find and fetch the champion, promote."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from flytekit import task
from flytekit.types.directory import FlyteDirectory

from containers.images import CPU_IMAGE
from rlhf.tracking import model_registry as R
from rlhf.config.load import replace
from rlhf.config.schema import PPOConfig
from rlhf.config.sizes import derive_sizes
from rlhf.tracking.sinks import default_tracking_uri
from tasks.base import CPU_SMALL, TRACKING_SECRETS, retry_transient, workdir

Champion = NamedTuple("Champion", [("found", bool), ("version", str), ("val_score", float)])
Promotion = NamedTuple("Promotion", [("promoted", bool), ("reason", str)])


def registry_uri(cfg: PPOConfig) -> str:
    return default_tracking_uri(cfg.trainer.mlflow_tracking_uri, cfg.trainer.output_dir)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE)
def retrain_config(cfg: PPOConfig, train_files: str, val_files: str, run_date: datetime) -> PPOConfig:
    """`cfg` with the given dataset paths ("" keeps the config's), checked like `check_config`;
    `{date}` in a path becomes the run date (YYYY-MM-DD), so a nightly run reads that day's files."""
    day = run_date.strftime("%Y-%m-%d")
    overrides = [f"data.{key}={path.replace('{date}', day)}"
                 for key, path in (("train_files", train_files), ("val_files", val_files)) if path]
    checked = replace(cfg, overrides)
    derive_sizes(checked)
    return checked


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def find_champion(cfg: PPOConfig, model_name: str) -> Champion:
    """The version holding the `champion` alias of `model_name`, if any."""
    with retry_transient():
        mv = R.champion(registry_uri(cfg), model_name)
    if mv is None:
        return Champion(found=False, version="", val_score=float("nan"))
    return Champion(found=True, version=mv.version, val_score=mv.val_score)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def download_champion(cfg: PPOConfig, model_name: str, version: str) -> FlyteDirectory:
    """The policy directory of version `version` (the champion), from the registry's artifact store."""
    uri = registry_uri(cfg)
    with retry_transient():
        return FlyteDirectory(path=R.download(uri, R.version(uri, model_name, version), workdir("champion")))


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def register_model(cfg: PPOConfig, model_name: str, policy: FlyteDirectory, val_score: float, run_id: str) -> str:
    """Register `policy` as a new version of `model_name` (logged under MLflow run `run_id`,
    or a new run), tagged with its val score; returns the version."""
    with retry_transient():
        mv = R.register(registry_uri(cfg), model_name, policy.download(), val_score,
                        experiment=cfg.trainer.project_name, run_id=run_id)
    return mv.version


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def promote(cfg: PPOConfig, model_name: str, version: str, champion_found: bool, champion_score: float
            ) -> Promotion:
    """Give `version` the `champion` alias if its val score beats `champion_score` by more than
    `early_stop.min_delta`: the champion's score, or with no champion yet the starting policy's
    (both measured on the same val set); the verdict and reason are tagged on the version."""
    uri = registry_uri(cfg)
    with retry_transient():
        mv = R.version(uri, model_name, version)
        promoted, reason = R.decide_promotion(uri, model_name, mv, champion_score, cfg.early_stop.min_delta,
                                              "champion" if champion_found else "starting policy")
    return Promotion(promoted=promoted, reason=reason)
