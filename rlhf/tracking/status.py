"""Ending a tracked launch that failed: its MLflow run is set FAILED, not left RUNNING.

The in-process driver ends its own run (`rlhf.train.train`). A Flyte launch opens its MLflow
run in one task and closes it in the last; when a task between them fails, the workflow's
failure handler (`tasks.run.fail_tracking`) runs with the workflow's inputs only. So the run
carries a tag naming its launch (`LAUNCH_TAG`: the Flyte execution, plus host and process for a
local execution, where every launch is named "local"), and the handler ends the RUNNING runs
of that launch as FAILED, with the error as a tag.
"""

from __future__ import annotations

import os
import socket
from rlhf.config.redact import redact
from rlhf.tracking.sinks import TAG_VALUE_MAX

LAUNCH_TAG = "rlhf.launch"
ERROR_TAG = "rlhf.error"


def launch_key(project: str, domain: str, name: str, local: bool) -> str:
    """The tag value that identifies one launch (unique per process for local executions)."""
    key = f"{project}/{domain}/{name}"
    return f"{key}@{socket.gethostname()}:{os.getpid()}" if local else key


def fail_launch_runs(tracking_uri: str, experiment: str, launch: str, error: str = "") -> list[str]:
    """Set every RUNNING run of `experiment` tagged with `launch` to FAILED (the error, cut to
    MLflow's tag limit, as tag `rlhf.error`); returns their ids."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], f"tags.`{LAUNCH_TAG}` = '{launch}' and "
                                                   "attributes.status = 'RUNNING'")
    for run in runs:
        if error:
            client.set_tag(run.info.run_id, ERROR_TAG, redact(error)[:TAG_VALUE_MAX])
        client.set_terminated(run.info.run_id, status="FAILED")
    return [r.info.run_id for r in runs]
