"""Trained policies in the MLflow model registry, and champion/challenger promotion.

A policy directory (safetensors + tokenizer) is logged as the artifact `model` of an
MLflow run and registered as a new version of a registered model; its validation score
is a tag of the version. The alias `champion` marks the version that retraining starts
from and that a new version must beat, on the same validation set, to take the alias.
Only this module (and `rlhf.tracking.sinks`) imports mlflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional
from rlhf.tracking.sinks import MLflowSink

CHAMPION = "champion"
VAL_SCORE_TAG = "val_score"
DECISION_TAG = "promotion"
REASON_TAG = "promotion_reason"


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str
    source: str  # artifact URI of the policy directory
    run_id: str
    val_score: float  # NaN when the version carries no score


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _as_version(mv) -> ModelVersion:
    score = mv.tags.get(VAL_SCORE_TAG) if mv.tags else None
    return ModelVersion(name=mv.name, version=str(mv.version), source=mv.source, run_id=mv.run_id or "",
                        val_score=float(score) if score is not None else math.nan)


def register(tracking_uri: str, name: str, model_dir: str, val_score: float, experiment: str = "rlhf-ppo",
             run_id: str = "", tags: Optional[dict[str, str]] = None) -> ModelVersion:
    """Log `model_dir` as artifact `model` of MLflow run `run_id` (a new run in `experiment`
    when empty) and register it as a new version of `name` tagged with its val score."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    if run_id:  # an existing (training) run: add the files, leave its status alone
        client.log_artifacts(run_id, model_dir, "model")
    else:
        sink = MLflowSink(tracking_uri, experiment, run_name=f"register-{name}")
        try:
            sink.log_artifact(model_dir, artifact_path="model")
        finally:
            sink.close()
        run_id = sink.run_id
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/model"
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name)
    version_tags = {VAL_SCORE_TAG: repr(float(val_score)), **(tags or {})}
    mv = client.create_model_version(name, source, run_id=run_id, tags=version_tags)
    return _as_version(client.get_model_version(name, mv.version))


def champion(tracking_uri: str, name: str) -> Optional[ModelVersion]:
    """The version holding the `champion` alias, or None (no such model or alias yet)."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    try:
        return _as_version(client.get_model_version_by_alias(name, CHAMPION))
    except MlflowException:
        return None


def version(tracking_uri: str, name: str, version: str) -> ModelVersion:
    """Version `version` of registered model `name`."""
    return _as_version(_client(tracking_uri).get_model_version(name, version))


def download(tracking_uri: str, version: ModelVersion, dst_dir: str) -> str:
    """The version's policy directory copied to `dst_dir`; returns the local path."""
    import mlflow.artifacts

    return mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=dst_dir,
                                               tracking_uri=tracking_uri)


def promotion_decision(challenger: float, incumbent: Optional[float], min_delta: float = 0.0,
                       incumbent_name: str = "champion") -> tuple[bool, str]:
    """Whether a challenger scoring `challenger` takes the alias from an incumbent scoring
    `incumbent` (None: nothing to beat), and why. Before there is a champion, the incumbent
    is the starting policy (`incumbent_name="starting policy"`): a retraining that made the
    policy worse is not promoted."""
    if not math.isfinite(challenger):
        return False, f"challenger val score {challenger} is not finite"
    head = "no champion yet; " if incumbent_name != "champion" else ""
    if incumbent is None or not math.isfinite(incumbent):
        return True, f"no champion yet; challenger val score {challenger:.4f}"
    if challenger > incumbent + min_delta:
        return True, f"{head}challenger val score {challenger:.4f} beats {incumbent_name} {incumbent:.4f}"
    return False, (f"{head}challenger val score {challenger:.4f} does not beat {incumbent_name} {incumbent:.4f}"
                   + (f" by more than {min_delta}" if min_delta else ""))


def decide_promotion(tracking_uri: str, name: str, version: ModelVersion, incumbent: Optional[float],
                     min_delta: float = 0.0, incumbent_name: str = "champion") -> tuple[bool, str]:
    """Apply `promotion_decision` to registered `version`: move the `champion` alias to it when
    it wins; record the verdict and its reason as tags of the version either way."""
    promoted, reason = promotion_decision(version.val_score, incumbent, min_delta, incumbent_name)
    client = _client(tracking_uri)
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    client.set_model_version_tag(name, version.version, DECISION_TAG, "promoted" if promoted else "rejected")
    client.set_model_version_tag(name, version.version, REASON_TAG, reason)
    return promoted, reason
