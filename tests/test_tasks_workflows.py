"""The workflows executed locally: `pyflyte run` with a config file, a dataset with a bad row,
and the nightly retraining launch plan twice in a row against a local MLflow store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf.config import PPOConfig, flatten, load_config
from test_trainer import TINY

ROOT = Path(__file__).resolve().parents[1]
QUICK = TINY + ["trainer.total_rounds=1", "trainer.val_before_train=false"]


@pytest.fixture(autouse=True)
def _no_flyte_cache(monkeypatch):
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")


def changed_keys_yaml(cfg: PPOConfig, path: Path) -> Path:
    """A YAML config holding only the keys that differ from the defaults (as a user writes one)."""
    defaults, tree = flatten(PPOConfig()), {}
    for key, value in flatten(cfg).items():
        if defaults[key] != value:
            *parents, leaf = key.split(".")
            node = tree
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
    path.write_text(yaml.safe_dump(tree))
    return path


def test_bad_row_fails_with_the_row_and_column(tmp_path):
    from rlhf.data.arithmetic import make_arithmetic
    from workflows.ppo import ppo_pipeline

    train = make_arithmetic(16, seed=1)
    train.loc[5, "prompt"] = "   "
    train.to_parquet(tmp_path / "train.parquet")
    make_arithmetic(8, seed=2).to_parquet(tmp_path / "val.parquet")
    cfg = load_config(None, QUICK + [f"data.train_files={tmp_path}/train.parquet",
                                     f"data.val_files={tmp_path}/val.parquet", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(Exception) as err:
        ppo_pipeline(cfg=cfg)
    message = str(err.value)
    assert "train.parquet" in message and "row 5" in message and "column 'prompt'" in message, message


def test_bad_config_fails_before_any_work(tmp_path):
    """A value the CLI parser lets through (pyflyte builds the dataclass without checks)
    stops the run in its first task, with the key named."""
    import dataclasses

    from rlhf.config import ConfigError
    from workflows.ppo import ppo_pipeline

    cfg = load_config(None, QUICK + [f"trainer.output_dir={tmp_path}"])
    bad = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, ppo_mini_batch_size=3))
    with pytest.raises(Exception, match="actor.ppo_mini_batch_size") as err:
        ppo_pipeline(cfg=bad)
    assert isinstance(err.value, ConfigError) or "ConfigError" in str(err.value)
    assert not list(tmp_path.iterdir()), "work started before the config was checked"


@pytest.mark.slow
def test_pyflyte_run_with_a_config_file(tmp_path):
    """The README's command on a tiny config file; two ranks, so the update goes through the
    torch elastic launcher (gloo on CPU)."""
    cfg = load_config(None, QUICK + [f"trainer.output_dir={tmp_path}", "trainer.n_gpus_per_node=2"])
    cfg_file = changed_keys_yaml(cfg, tmp_path / "my.yaml")
    proc = subprocess.run([str(Path(sys.executable).parent / "pyflyte"), "run", "workflows/ppo.py", "ppo_pipeline",
                           "--cfg", str(cfg_file)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "FLYTE_LOCAL_CACHE_ENABLED": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "Pipeline(model=" in out and "round=1, global_step=1" in out, out[-3000:]
    assert "round_000001/actor" in out  # the policy output points into the uploaded checkpoint


@pytest.mark.slow
def test_nightly_retraining_twice_starts_from_the_champion(tmp_path):
    from rlhf.tracking import model_registry as R
    from workflows.retrain import ppo_retrain_nightly

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(None, QUICK + [f"trainer.output_dir={tmp_path}", f"trainer.mlflow_tracking_uri={uri}",
                                     "trainer.logger=[mlflow]"])
    first = ppo_retrain_nightly(cfg=cfg, model_name="nightly")
    # With no champion yet, the first model must beat its own starting policy on the same val set.
    assert first.started_from == "" and "no champion yet" in first.reason and "starting policy" in first.reason
    assert first.promoted == (" beats starting policy" in first.reason), first.reason
    champion = R.champion(uri, "nightly")
    assert (champion.version if champion else "") == (first.version if first.promoted else "")
    assert_one_tracked_run(uri, R.version(uri, "nightly", first.version).run_id)
    if not first.promoted:  # crown it by hand, so that the second run starts from a champion
        from mlflow.tracking import MlflowClient

        MlflowClient(uri, registry_uri=uri).set_registered_model_alias("nightly", R.CHAMPION, first.version)

    second = ppo_retrain_nightly(cfg=cfg, model_name="nightly")
    assert second.started_from == first.version
    assert second.version != first.version
    # Both scores come from the same val set: the champion's is the one it was registered with.
    challenger = R.version(uri, "nightly", second.version).val_score
    incumbent = R.version(uri, "nightly", first.version).val_score
    assert second.promoted == (challenger > incumbent), (challenger, incumbent, second.reason)
    assert R.champion(uri, "nightly").version == (second.version if second.promoted else first.version)
    assert ("beats" if second.promoted else "does not beat") in second.reason
    assert second.metrics["step"].tolist() == [1]


def assert_one_tracked_run(uri: str, run_id: str) -> None:
    """The stateless tasks of one training run all logged into the same MLflow run, which
    also holds the registered model's files."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["actor.clip_ratio"] == "0.2"
    for key in ("actor/pg_loss", "critic/vf_loss", "response_length/mean", "val/accuracy", "global_steps"):
        assert key in run.data.metrics, (key, sorted(run.data.metrics))
    assert [m.step for m in client.get_metric_history(run_id, "actor/pg_loss")] == [1]
    assert run.data.tags["stop_reason"] == "total_rounds reached"
    assert "model" in [a.path for a in client.list_artifacts(run_id)]
