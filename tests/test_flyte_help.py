"""`pyflyte run workflows/ppo.py ppo_pipeline --help` says what each config key means."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _properties(schema: dict, prefix: str = "") -> dict[str, dict]:
    out = {}
    for name, prop in schema.get("properties", {}).items():
        if "properties" in prop:
            out.update(_properties(prop, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = prop
    return out


def test_the_config_input_schema_carries_every_documented_description():
    import tasks.base  # noqa: F401  (describes the config fields, as every task module does)
    from flytekit.core.type_engine import TypeEngine

    from rlhf.config import PPOConfig
    from rlhf.config.doc import rows

    props = _properties(TypeEngine.to_literal_type(PPOConfig).metadata)
    documented = {key: note for key, _, _, note in rows() if note}
    assert len(documented) > 100
    for key, note in documented.items():
        assert props[key].get("description") == note, key


def test_pyflyte_help_points_to_the_reference_and_explains_keys():
    proc = subprocess.run([str(Path(sys.executable).parent / "pyflyte"), "run", "workflows/ppo.py", "ppo_pipeline",
                           "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    head = proc.stdout[:proc.stdout.index("--cfg")]
    assert "docs/CONFIG.md" in head and "python -m rlhf.train.check" in head
    text = " ".join(proc.stdout.replace("│", " ").split())  # rich wraps the schema into a box
    assert "PPO ratio clip epsilon" in text and "adaptive target; also the early-stop KL budget" in text
