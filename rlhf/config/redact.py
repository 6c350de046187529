"""Credentials kept out of what a run stores and prints.

`redact` replaces URI passwords (`scheme://user:PASSWORD@host`, matched by `URI_PASSWORD`)
and the values of the credential variables in `SECRET_ENV_VARS` with `***`. The config
check refuses a URI with a password; the tracking sinks redact params, tags and messages.
"""

from __future__ import annotations

import os
import re

# Environment variables that hold credentials: their values are never logged or stored.
SECRET_ENV_VARS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                   "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET", "HF_TOKEN", "WANDB_API_KEY",
                   "DATABRICKS_TOKEN")
URI_PASSWORD = re.compile(r"(?P<head>[A-Za-z][\w+.-]*://[^/@\s:]*):(?P<password>[^/@\s]+)@")


def redact(text: str) -> str:
    """`text` with URI passwords (`scheme://user:PASSWORD@host`) and the values of the
    credential variables in `SECRET_ENV_VARS` replaced by `***`."""
    text = URI_PASSWORD.sub(r"\g<head>:***@", str(text))
    for name in SECRET_ENV_VARS:
        secret = os.environ.get(name, "")
        if len(secret) >= 6:  # shorter values would blank out ordinary text
            text = text.replace(secret, "***")
    return text
