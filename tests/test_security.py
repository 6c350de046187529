"""What the pipeline refuses to load, where paths may lead, and where credentials never go.

- Model weights are safetensors; DeepSpeed's engine files are read weights-only, so a
  checkpoint file holding pickled code is refused before the code can run.
- Code shipped inside a checkpoint runs only with `model.trust_remote_code`.
- Dataset paths stay under `data.base_dir`; hub names are fetched only with `model.allow_network`.
- Secrets planted in the environment (MLflow token, cloud keys, a password in the tracking
  URI) are absent from the run's output, logs, checkpoints and its MLflow run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf.checkpoint import rounds as ckpt
from rlhf.config import ConfigError, load_config
from rlhf.data.io import DataValidationError, read_prompts
from rlhf.models.load import ModelLoadError, load_causal_lm, load_tokenizer
from tests.test_trainer import ROOT, TINY, _clean_env, tiny_cfg
from tests.tiny import small_model

SECRETS = {
    "MLFLOW_TRACKING_TOKEN": "tok-9f3c1e7a5b2d8e40",
    "AWS_SECRET_ACCESS_KEY": "aws-Zq8Lm2Vx9Pk4Rt7Wn3Yb",
    "AWS_SESSION_TOKEN": "sess-Hj5Kd8Fs2Ga7Qw1Ez",
}
URI_PASSWORD = "uri-Pw7Xc4Vb1Nm9Kl3"  # planted inside $MLFLOW_TRACKING_URI


def _with_password(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return parts._replace(netloc=f"rlhf-ci:{URI_PASSWORD}@{parts.netloc}").geturl()


# ---------------------------------------------------------------------------------
# Credentials: a real run with secrets planted, then every place they could leak to
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory, mlflow_server):
    """One round of `python -m rlhf.train` (console and MLflow sinks, ZeRO-1 so the checkpoint
    holds optimizer shards) with the secrets in its environment; returns what it left."""
    out = tmp_path_factory.mktemp("secret_run")
    name = f"secrets-{out.name}"
    env = {**_clean_env(), **SECRETS, "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0000",
           "MLFLOW_TRACKING_URI": _with_password(mlflow_server)}
    args = [a for a in TINY if not a.startswith("trainer.logger")] + [
        f"trainer.output_dir={out}", "trainer.total_rounds=1", "trainer.logger=[console,mlflow]",
        "trainer.project_name=ci-secrets", f"trainer.experiment_name={name}", "deepspeed.zero_stage=1",
        "model.sft.enable=false", "trainer.val_before_train=false"]
    proc = subprocess.run([sys.executable, "-m", "rlhf.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": out, "name": name, "stdout": proc.stdout, "stderr": proc.stderr, "server": mlflow_server}


def _planted() -> list[str]:
    return [*SECRETS.values(), URI_PASSWORD]


def _files_holding(root: Path, secrets: list[str]) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path.relative_to(root)}: {s}" for s in secrets if s.encode() in data]
    return found


@pytest.mark.slow
def test_planted_secrets_appear_nowhere(secret_run, tmp_path):
    from mlflow.tracking import MlflowClient

    secrets = _planted()
    out = secret_run["out"]
    assert "round 1/1" in secret_run["stdout"] and ckpt.latest_checkpoint(out) is not None  # the run happened
    logs = (secret_run["stdout"] + secret_run["stderr"]).splitlines()
    assert [line for line in logs if any(s in line for s in secrets)] == [], "a secret was printed"
    assert _files_holding(out, secrets) == [], "a secret was written under the output directory"

    client = MlflowClient(tracking_uri=secret_run["server"])
    exp = client.get_experiment_by_name("ci-secrets")
    (run,) = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{secret_run['name']}'")
    assert run.data.params["actor.clip_ratio"] == "0.2" and "actor/pg_loss" in run.data.metrics
    recorded = json.dumps([run.data.params, run.data.tags, sorted(run.data.metrics), run.info.to_proto().__str__(),
                           dict(exp.tags)])
    assert [s for s in secrets if s in recorded] == [], "a secret is in the MLflow run's params, tags or info"
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path)))
    assert (artifacts / "summary.json").is_file() and (artifacts / "final_model").is_dir()
    assert _files_holding(artifacts, secrets) == [], "a secret is in the MLflow run's artifacts"


def test_config_refuses_passwords_in_uris_and_does_not_echo_them():
    with pytest.raises(ConfigError, match=r"trainer.mlflow_tracking_uri.*http://u:\*\*\*@h.*MLFLOW_TRACKING_TOKEN") as e:
        load_config(None, [f"trainer.mlflow_tracking_uri=http://u:{URI_PASSWORD}@h:5000"])
    assert URI_PASSWORD not in str(e.value)
    with pytest.raises(ConfigError, match="'data.train_files' holds a password"):
        load_config(None, [f"data.train_files=https://u:{URI_PASSWORD}@h/t.parquet", "data.val_files=v.parquet"])
    assert load_config(None, ["data.train_files=hdfs://alice@nn:8020/t.parquet",
                              "data.val_files=v.parquet"]).data.train_files[0].startswith("hdfs://alice@")


def test_redact_hides_uri_passwords_and_secret_variables(monkeypatch):
    from rlhf.tracking.sinks import param_value, redact

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRETS["AWS_SECRET_ACCESS_KEY"])
    text = f"http://bob:{URI_PASSWORD}@host:5000/api and key={SECRETS['AWS_SECRET_ACCESS_KEY']} val/reward@1"
    assert redact(text) == "http://bob:***@host:5000/api and key=*** val/reward@1"
    assert param_value({"uri": f"s3://k:{URI_PASSWORD}@b/x"}) == '{"uri": "s3://k:***@b/x"}'


def test_buffered_tracking_warnings_do_not_show_the_uri_password(tmp_path, monkeypatch, caplog):
    """An unreachable server whose URI (from the environment) carries a password: the warnings
    name the server with the password redacted, and the buffer files do not hold it."""
    import socket

    from rlhf.tracking.buffer import BufferedMLflowSink

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once released: nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://bob:{URI_PASSWORD}@127.0.0.1:{port}")
    caplog.set_level("DEBUG")
    sink = BufferedMLflowSink(str(tmp_path / "buf"), "", "exp", "run", output_dir=str(tmp_path), retry_s=0)
    sink.log_params({"a": 1})
    sink.log_metrics({"m": 1.0}, step=1)
    sink.close()
    assert "unreachable" in caplog.text and f"bob:***@127.0.0.1:{port}" in caplog.text
    assert URI_PASSWORD not in caplog.text
    assert _files_holding(tmp_path, [URI_PASSWORD]) == []


def test_tracking_tasks_take_the_token_from_a_flyte_secret():
    """Every task that talks to MLflow requests the token secret as $MLFLOW_TRACKING_TOKEN;
    no task takes a credential as an input."""
    from tasks import evaluate, registry, run, update

    talking = [run.start_tracking, run.report, update.ppo_update, update.ppo_update_multinode, evaluate.evaluate,
               registry.find_champion, registry.download_champion, registry.register_model, registry.promote]
    for t in talking:
        secrets = [(s.group, s.key, s.env_var) for s in t.security_context.secrets]
        assert ("mlflow", "tracking_token", "MLFLOW_TRACKING_TOKEN") in secrets, t.name
    for t in talking + [run.check_config, evaluate.decide]:
        names = " ".join(t.python_interface.inputs).lower()
        assert not any(w in names for w in ("token", "password", "secret", "key")), t.name


# ---------------------------------------------------------------------------------
# Loading: pickles, DeepSpeed engine files, code inside checkpoints
# ---------------------------------------------------------------------------------


class _RunsCode:
    """Unpickling this runs `open(marker, "w")`: the shape of a malicious checkpoint file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.slow
def test_engine_state_is_read_weights_only_and_pickled_code_is_refused(secret_run, tmp_path):
    """A fresh trainer restores the ZeRO-1 checkpoint (optimizer shards included) through the
    weights-only reader; the same checkpoint with a file replaced by a pickle that would run
    code is refused, and the code does not run."""
    from rlhf.train import setup as P
    from rlhf.config import derive_sizes
    from rlhf.trainer import dist as D
    from rlhf.checkpoint.engine_state import UnsafeCheckpointError

    D.init_distributed(torch.device("cpu"))  # a one-rank gloo group, as the in-process driver makes
    good = ckpt.latest_checkpoint(secret_run["out"])
    bad = tmp_path / good.name
    shutil.copytree(good, bad)
    cfg = tiny_cfg(secret_run["out"], "deepspeed.zero_stage=1")
    base = str(secret_run["out"] / "base_model")
    trainer = P.build_trainer(cfg, derive_sizes(cfg, 1), base, torch.device("cpu"), good)
    state = ckpt.restore(trainer, good)
    assert state.round == 1 and trainer.actor.global_steps > 0  # the engine's step count came back

    marker = tmp_path / "code-ran"
    victim = next((bad / ckpt.ENGINE_DIR / "actor").rglob("*optim_states.pt"))
    torch.save({"optimizer_state_dict": _RunsCode(str(marker))}, victim)
    trainer = P.build_trainer(cfg, derive_sizes(cfg, 1), base, torch.device("cpu"), bad)
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*optim_states\.pt.*trainer.resume=disable"):
        ckpt.restore(trainer, bad)
    assert not marker.exists()


def _custom_code_dir(tmp_path: Path, tok, native: bool) -> tuple[Path, Path]:
    """A checkpoint whose config points at its own modeling code; importing that code
    creates a marker file. `native`: the model type is also one transformers provides."""
    path, marker = tmp_path / "custom", tmp_path / "custom-code-ran"
    model = small_model(tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    code = f"open({str(marker)!r}, 'w').close()\nfrom transformers import LlamaConfig, LlamaForCausalLM\n" \
           "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n" \
           "class EvilForCausalLM(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    (path / "modeling_evil.py").write_text(code)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    if not native:
        config["model_type"] = "evil"
    (path / "config.json").write_text(json.dumps(config))
    return path, marker


def test_code_inside_a_checkpoint_runs_only_with_trust_remote_code(tok, tmp_path):
    path, marker = _custom_code_dir(tmp_path, tok, native=False)
    with pytest.raises(ModelLoadError, match=r"model code shipped inside the checkpoint.*model.trust_remote_code"):
        load_causal_lm(str(path))
    assert not marker.exists()
    model = load_causal_lm(str(path), trust_remote_code=True)  # the switch is honoured when set
    assert type(model).__name__ == "EvilForCausalLM" and marker.exists()


def test_custom_code_beside_a_native_model_type_is_not_run(tok, tmp_path):
    path, marker = _custom_code_dir(tmp_path, tok, native=True)
    model = load_causal_lm(str(path))
    assert type(model).__name__ == "LlamaForCausalLM" and not marker.exists()
    assert load_tokenizer(str(path)).eos_token == tok.eos_token and not marker.exists()


def test_pipeline_loads_no_pickles():
    """No `torch.load` in the project reads a file without `weights_only=True`; DeepSpeed's
    own reader is replaced on restore (test above)."""
    offenders = []
    for folder in ("rlhf", "tasks", "workflows", "sweeps", "schemas", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if "torch.load(" in line and "weights_only=True" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{i}")
                if "pickle.load" in line or "trust_remote_code=True" in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{i}")
    assert offenders == []


# ---------------------------------------------------------------------------------
# Paths and the network
# ---------------------------------------------------------------------------------


def _prompt_file(path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["1+1="], "data_source": ["synthetic/arithmetic"], "ability": ["math"],
                             "reward_style": ["rule"], "ground_truth": ["2"], "extra_info": ["{}"]}), path)


def test_dataset_paths_from_the_config_stay_under_base_dir(tmp_path):
    """`../`, absolute paths and links (to a file, or inside a listed directory) that lead out of
    `data.base_dir` are refused, through the config as the pipeline reads it."""
    from rlhf.round.stages import prepare_data

    base, outside = tmp_path / "base", tmp_path / "outside"
    (base / "shards").mkdir(parents=True)
    outside.mkdir()
    _prompt_file(base / "train.parquet")
    _prompt_file(base / "shards" / "a.parquet")
    _prompt_file(outside / "secret.parquet")
    os.symlink(outside / "secret.parquet", base / "shards" / "b.parquet")
    os.symlink(outside, base / "linked_dir")

    def data(train: str):
        return load_config(None, [f"data.base_dir={base}", f"data.train_files={train}",
                                  "data.val_files=train.parquet"])

    assert len(prepare_data(data("train.parquet")).train) == 1
    for escaping in ("../outside/secret.parquet", str(outside / "secret.parquet"), "shards",
                     "linked_dir/secret.parquet", "linked_dir", f"{base}/../outside/secret.parquet"):
        with pytest.raises(DataValidationError, match="outside data.base_dir"):
            prepare_data(data(escaping))
    assert len(read_prompts(str(base / "shards"))) == 2  # without a base dir links are followed


def test_hub_names_are_not_fetched_without_allow_network(tmp_path, monkeypatch):
    """A model name that is not a local directory is refused before any download is tried,
    for the policy (through the config) and the critic and tokenizer loaders."""
    from rlhf.models.load import ValueModel
    from rlhf.round.policy import prepare_policy
    from rlhf.round.stages import DataBundle

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the refusal must not rely on offline mode
    cfg = load_config(None, ["model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    with pytest.raises(ModelLoadError, match="model.allow_network=true"):
        prepare_policy(cfg, tmp_path, DataBundle(train=None, val=None, sft=None))
    with pytest.raises(ModelLoadError, match="allow_network"):
        ValueModel.from_causal_lm_dir("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ModelLoadError, match="allow_network"):
        load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")
