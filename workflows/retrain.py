"""Scheduled retraining with champion/challenger promotion in the MLflow model registry.

A retraining run starts from the version holding the `champion` alias of `model_name`
(or, before there is one, from the configured starting policy), trains on the data it is
given, scores the new policy and its starting policy (the champion, or before there is one
the configured starting policy) on the same validation set, registers the new policy as a
version, and moves `champion` to it only when it scores higher; the verdict and its reason
are tags of the new version.

    pyflyte run workflows/retrain.py ppo_retrain --cfg my.yaml --train_files s3://b/{date}/train.parquet
    pyflyte register workflows --image ...   # registers `ppo_retrain_nightly` (see docs/FLYTE.md, "Scheduled retraining")
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

import pandas as pd
from flytekit import ConcurrencyLimitBehavior, ConcurrencyPolicy, CronSchedule, LaunchPlan, conditional, workflow
from flytekit.types.directory import FlyteDirectory

from rlhf.config.schema import PPOConfig, TrainerConfig
from tasks.data import prepare_policy
from tasks.evaluate import score_policy
from tasks.registry import download_champion, find_champion, promote, register_model, retrain_config
from tasks.run import fail_retrain_tracking
from workflows.ppo import ppo_train, prepare_data

MODEL_NAME = "rlhf-ppo-policy"
NIGHTLY_CRON = "0 3 * * *"  # every day at 03:00 UTC
EPOCH = datetime(1970, 1, 1)
# The scheduled run's config: metrics and the registry on a shared MLflow server.
NIGHTLY_CFG = PPOConfig(trainer=TrainerConfig(logger=["console", "mlflow"],
                                              mlflow_tracking_uri="http://mlflow.mlflow.svc.cluster.local:5000"))

Retrained = NamedTuple("Retrained", [("model", FlyteDirectory), ("metrics", pd.DataFrame), ("version", str),
                                     ("promoted", bool), ("reason", str), ("started_from", str)])


@workflow(on_failure=fail_retrain_tracking)
def ppo_retrain(cfg: PPOConfig = PPOConfig(), train_files: str = "", val_files: str = "",
                model_name: str = MODEL_NAME, run_date: datetime = EPOCH) -> Retrained:
    """Retrain from the champion on `train_files`/`val_files` ("" keeps `cfg.data`; `{date}`
    becomes `run_date`) and promote the result if it beats the champion."""
    run_cfg = retrain_config(cfg=cfg, train_files=train_files, val_files=val_files, run_date=run_date)
    data = prepare_data(cfg=run_cfg)
    champ = find_champion(cfg=run_cfg, model_name=model_name)
    start = (conditional("start_model")
             .if_(champ.found.is_true())
             .then(download_champion(cfg=run_cfg, model_name=model_name, version=champ.version))
             .else_()
             .then(prepare_policy(model=run_cfg.model, seed=run_cfg.trainer.seed, sft=data.sft)))
    trained = ppo_train(cfg=run_cfg, train=data.train, val=data.val, base_model=start)
    champion_score = score_policy(cfg=run_cfg, policy=start, val=data.val)
    challenger_score = score_policy(cfg=run_cfg, policy=trained.model, val=data.val)
    version = register_model(cfg=run_cfg, model_name=model_name, policy=trained.model, val_score=challenger_score,
                             run_id=trained.run_id)
    decision = promote(cfg=run_cfg, model_name=model_name, version=version, champion_found=champ.found,
                       champion_score=champion_score)
    return Retrained(model=trained.model, metrics=trained.metrics, version=version, promoted=decision.promoted,
                     reason=decision.reason, started_from=champ.version)


ppo_retrain_nightly = LaunchPlan.get_or_create(
    workflow=ppo_retrain,
    name="ppo_retrain_nightly",
    default_inputs={"cfg": NIGHTLY_CFG, "model_name": MODEL_NAME},
    schedule=CronSchedule(schedule=NIGHTLY_CRON, kickoff_time_input_arg="run_date"),
    # One retraining at a time: a tick that finds the previous run still going is skipped.
    concurrency=ConcurrencyPolicy(max_concurrency=1, behavior=ConcurrencyLimitBehavior.SKIP),
)
