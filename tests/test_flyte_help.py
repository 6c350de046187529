"""`pyflyte run workflows/ppo.py ppo_pipeline`: the config input's schema carries every key's meaning (the Flyte
console shows it), `--help` is a screenful that points to the reference, and a bad value in
`--cfg` is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def _pyflyte(monkeypatch, *args: str):
    """`pyflyte run workflows/ppo.py ppo_pipeline ARGS` in this process (flytekit's own command)."""
    from click.testing import CliRunner
    from flytekit.clis.sdk_in_container.pyflyte import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at the terminal's width
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")
    return CliRunner().invoke(main, ["run", "workflows/ppo.py", "ppo_pipeline", *args])


def test_pyflyte_help_is_short_and_points_to_the_reference(monkeypatch):
    """The help names the config file option, where every key is explained and how to check a
    launch first, in a screenful (before: about 670 lines of the config's JSON schema)."""
    result = _pyflyte(monkeypatch, "--help")
    assert result.exit_code == 0, result.output
    text = result.output
    assert len(text.strip().splitlines()) <= 30, text
    assert "--cfg" in text and "docs/CONFIG.md" in text and "python -m rlhf.train.check" in text
    assert '"properties"' not in text and "PPO ratio clip epsilon" not in text


@pytest.mark.slow
@pytest.mark.parametrize("value,message", [("2", "actor.clip_ratio must be in (0, 1), got 2.0"),
                                           ("abc", "config key 'actor.clip_ratio' expects float, got 'abc'")])
def test_a_bad_value_in_cfg_is_reported_in_one_line(monkeypatch, tmp_path, value, message):
    """A value the config refuses (or one pyflyte cannot even decode into it, so that it passes
    the file's path on) stops the launch in its first task with the message alone, no traceback
    (before: a 50-line traceback of the task above it)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"actor:\n  clip_ratio: {value}\ntrainer:\n  output_dir: {tmp_path / 'out'}\n")
    result = _pyflyte(monkeypatch, "--cfg", str(bad))
    assert result.exit_code == 1
    assert message in result.output, result.output
    assert "Traceback" not in result.output and "check_config" not in result.output, result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 5, result.output
    assert not (tmp_path / "out").exists()
