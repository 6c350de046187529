"""Flyte task adapters: typed values across the boundary, the torchrun shape, error mapping,
the MLflow registry, the training deck, and the offline package of every workflow."""

from __future__ import annotations

import base64
import io
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from rlhf.config import load_config
from rlhf.round.state import RoundState

ROOT = Path(__file__).resolve().parents[1]


# -- typed values ---------------------------------------------------------------------------


def _round_trip(value, tp):
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    ctx = FlyteContextManager.current_context()
    lit = TypeEngine.to_literal(ctx, value, tp, TypeEngine.to_literal_type(tp))
    return TypeEngine.to_python_value(ctx, lit, tp)


def test_config_and_state_cross_task_boundaries_unchanged():
    """The frozen nested config (lists, Optional) and the state (list of dicts) survive Flyte's
    literal encoding exactly."""
    from rlhf.config import PPOConfig

    cfg = load_config(None, ["actor.clip_ratio_low=0.1", "trainer.logger=[console,mlflow]",
                             "trainer.profile_steps=[2,5]", "data.synthetic.operators=+-"])
    back = _round_trip(cfg, PPOConfig)
    assert back == cfg and back.actor.clip_ratio_high is None and back.trainer.logger == ["console", "mlflow"]
    state = RoundState(round=2, kl_coef=0.01, step_history=[{"step": 1.0, "actor/pg_loss": -0.5}],
                       val_history=[{"round": 0.0, "step": 0.0, "score": 0.25}], stop_reason="x")
    assert _round_trip(state, RoundState) == state


def _cli_cfg(value: str):
    """What `pyflyte run workflows/ppo.py ppo_pipeline --cfg VALUE` builds from a YAML/JSON file
    or a JSON string (flytekit's click type for dataclass inputs)."""
    from flytekit.interaction.click_types import JsonParamType

    from rlhf.config import PPOConfig

    return JsonParamType(PPOConfig).convert(value, None, None)


def test_cli_config_with_an_unknown_key_is_refused(tmp_path):
    """A misspelled key or section in `--cfg` stops the launch with its dotted path and the
    closest valid name, instead of being dropped (the run going ahead with the default)."""
    import json

    from rlhf.config import ConfigError

    yml = tmp_path / "my.yaml"
    yml.write_text("trainer:\n  total_rounds: 3\nactor:\n  clip_ratoi: 0.1\n")
    with pytest.raises(ConfigError, match=r"'actor\.clip_ratoi'.*did you mean 'actor\.clip_ratio'\? Correct or remove"):
        _cli_cfg(str(yml))
    js = tmp_path / "my.json"
    js.write_text(json.dumps({"algorithm": {"kl_ctrl": {"kl_coeff": 0.1}}}))
    with pytest.raises(ConfigError, match=r"'algorithm\.kl_ctrl\.kl_coeff'.*'algorithm\.kl_ctrl\.kl_coef'"):
        _cli_cfg(str(js))
    with pytest.raises(ConfigError, match=r"'algorthm'.*did you mean 'algorithm'"):
        _cli_cfg(json.dumps({"algorthm": {"gamma": 0.9}}))


def test_cli_config_keeps_valid_files_and_their_types(tmp_path):
    """Valid `--cfg` values convert as before: partial JSON, ints given for floats, nulls, lists,
    and a whole saved config (the sweep's best_config.yaml is one)."""
    from rlhf.config import save_config

    cfg = _cli_cfg('{"actor": {"lr": 1, "clip_ratio_low": null}, "trainer": {"logger": ["console", "mlflow"]}}')
    assert cfg == load_config(None, ["actor.lr=1.0", "trainer.logger=[console,mlflow]"])
    assert type(cfg.actor.lr) is float and cfg.actor.clip_ratio_low is None
    whole = load_config(None, ["actor.clip_ratio=0.3", "algorithm.kl_ctrl.kl_coef=0.01", "trainer.profile_steps=[2]"])
    save_config(whole, tmp_path / "best_config.yaml")
    assert _cli_cfg(str(tmp_path / "best_config.yaml")) == whole


def test_config_literal_with_an_unknown_key_is_refused():
    """A config input built outside flytekit's encoder (a console or flytectl launch) is held to
    the same keys when the task decodes it."""
    import dataclasses

    import msgpack
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Binary, Literal, Scalar

    from rlhf.config import PPOConfig

    data = dataclasses.asdict(PPOConfig())
    data["actor"]["clip_ratoi"] = 0.1
    lit = Literal(scalar=Scalar(binary=Binary(value=msgpack.dumps(data), tag="msgpack")))
    with pytest.raises(Exception, match=r"'actor\.clip_ratoi'.*did you mean 'actor\.clip_ratio'"):
        TypeEngine.to_python_value(FlyteContextManager.current_context(), lit, PPOConfig)


def test_prompt_tables_are_validated_at_the_boundary():
    import pandera.errors

    from rlhf.data.arithmetic import make_arithmetic
    from tasks.base import Prompts

    good = make_arithmetic(4, seed=0)
    assert _round_trip(good, Prompts).equals(good)
    bad = good.assign(reward_style=["rule", "oracle", "rule", "rule"])
    with pytest.raises(pandera.errors.SchemaErrors, match="reward_style"):
        _round_trip(bad, Prompts)


# -- torchrun shape ---------------------------------------------------------------------------


def _settings():
    from flytekit.configuration import ImageConfig, SerializationSettings

    return SerializationSettings(image_config=ImageConfig.auto_default_image())


def test_update_task_follows_the_run_shape():
    from tasks.update import RunShapedElastic, elastic_for, ppo_update, ppo_update_multinode, update_task

    one = load_config(None, ["trainer.n_gpus_per_node=4"])
    assert update_task(one) is ppo_update
    assert elastic_for(one) == RunShapedElastic(nnodes=1, nproc_per_node=4, rdzv_configs=elastic_for(one).rdzv_configs)
    many = load_config(None, ["trainer.nnodes=4", "trainer.n_gpus_per_node=8"])
    t = update_task(many)
    assert t is ppo_update_multinode
    t._task_config = elastic_for(many)  # what the workflow's with_overrides(task_config=...) sets
    custom = t.get_custom(_settings())
    assert custom["elasticConfig"]["minReplicas"] == 4 and custom["elasticConfig"]["maxReplicas"] == 4
    assert custom["elasticConfig"]["nprocPerNode"] == 8 and custom["workerReplicas"]["replicas"] == 4


def test_transient_failures_become_recoverable():
    from flytekit.exceptions.user import FlyteRecoverableException

    from tasks.base import retry_transient

    with pytest.raises(FlyteRecoverableException, match="ConnectionResetError"):
        with retry_transient():
            raise ConnectionResetError("peer reset")
    with pytest.raises(ValueError):
        with retry_transient():
            raise ValueError("a config error is not retried")


# -- MLflow registry: champion and challenger -------------------------------------------------


def _fake_policy(path: Path, tag: str) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"tag": "%s"}' % tag)
    return str(path)


def test_champion_alias_moves_only_to_a_better_score(tmp_path):
    from rlhf.tracking import model_registry as R

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert R.champion(uri, "policy") is None
    v1 = R.register(uri, "policy", _fake_policy(tmp_path / "a", "a"), 0.5)
    assert R.decide_promotion(uri, "policy", v1, None)[0]
    v2 = R.register(uri, "policy", _fake_policy(tmp_path / "b", "b"), 0.5)
    promoted, reason = R.decide_promotion(uri, "policy", v2, R.champion(uri, "policy").val_score)
    assert not promoted and "does not beat" in reason
    assert R.champion(uri, "policy").version == v1.version
    v3 = R.register(uri, "policy", _fake_policy(tmp_path / "c", "c"), 0.75)
    assert R.decide_promotion(uri, "policy", v3, 0.5) == (True, "challenger val score 0.7500 beats champion 0.5000")
    champ = R.champion(uri, "policy")
    assert (champ.version, champ.val_score) == (v3.version, 0.75)
    local = R.download(uri, champ, str(tmp_path / "dl"))
    assert '"c"' in (Path(local) / "config.json").read_text()
    assert R.version(uri, "policy", v2.version).val_score == 0.5
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(uri).get_model_version("policy", v2.version).tags
    assert tags[R.DECISION_TAG] == "rejected" and "does not beat" in tags[R.REASON_TAG]


def test_promotion_rule():
    from rlhf.tracking.model_registry import promotion_decision

    assert promotion_decision(0.6, 0.5)[0] and not promotion_decision(0.5, 0.5)[0]
    assert not promotion_decision(0.55, 0.5, min_delta=0.1)[0]
    assert not promotion_decision(math.nan, None)[0] and promotion_decision(0.0, None)[0]


def test_with_no_champion_yet_the_starting_policy_is_the_one_to_beat():
    from rlhf.tracking.model_registry import promotion_decision

    assert promotion_decision(0.118, 0.138, incumbent_name="starting policy") == (
        False, "no champion yet; challenger val score 0.1180 does not beat starting policy 0.1380")
    assert promotion_decision(0.2, 0.138, incumbent_name="starting policy") == (
        True, "no champion yet; challenger val score 0.2000 beats starting policy 0.1380")


# -- console deck -----------------------------------------------------------------------------


def test_training_deck_renders_every_panel_and_the_stop_reason():
    from PIL import Image

    from rlhf.tracking.plots import PANELS, training_figure, training_html

    hist = [{"step": float(i), "critic/score/mean": 0.1 * i, "actor/current_kl": 0.01 * i,
             "actor/reward_kl_penalty_coeff": 0.001, "actor/pg_loss": -0.1, "critic/vf_loss": 0.2,
             "actor/entropy": 1.0 - 0.1 * i, "actor/pg_clipfrac": 0.05, "response_length/mean": 7.0,
             "actor/grad_norm": 0.3} for i in range(1, 5)]
    state = RoundState(round=4, global_step=4, step_history=hist, best_val=0.5, val_start=0.25, last_val=0.5,
                       val_history=[{"round": 0.0, "step": 0.0, "score": 0.25},
                                    {"round": 4.0, "step": 4.0, "score": 0.5}])
    fig = training_figure(state, "KL above the ceiling")
    drawn = [ax for ax in fig.axes if ax.lines and len(ax.lines[0].get_xdata()) > 0]
    assert len(drawn) >= 1 + len(PANELS)  # val score + every panel (+ the KL coefficient's twin axis)
    html = training_html(state, "KL above the ceiling <0.2>")
    assert "KL above the ceiling &lt;0.2&gt;" in html and 'class="training-curves"' in html
    png = base64.b64decode(html.split("base64,")[1].split('"')[0])
    img = Image.open(io.BytesIO(png))
    assert img.size[0] > 800 and sum(1 for n in img.convert("L").histogram() if n) > 10  # drawn, not blank


# -- the offline package ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("pkg") / "flyte-package.tgz"
    proc = subprocess.run([sys.executable, "-m", "flytekit.clis.sdk_in_container.pyflyte", "--pkgs", "workflows",
                           "package", "--image", "ghcr.io/example/flyte-rlhf:test", "-o", str(out), "--force"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with tarfile.open(out) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _entity(package: dict[str, bytes], suffix: str, cls):
    (name,) = [n for n in package if n.endswith(suffix)]
    msg = cls()
    msg.ParseFromString(package[name])
    return msg


def _task(package, name):
    from flyteidl.admin import task_pb2

    return _entity(package, f"_{name}_1.pb", task_pb2.TaskSpec).template


def _resources(t) -> dict[str, str]:
    from flyteidl.core import tasks_pb2

    return {tasks_pb2.Resources.ResourceName.Name(r.name): r.value for r in t.container.resources.requests}


def test_package_holds_the_schedule_and_concurrency(package):
    from flyteidl.admin import launch_plan_pb2

    lp = _entity(package, "ppo_retrain_nightly_3.pb", launch_plan_pb2.LaunchPlan)
    sched = lp.spec.entity_metadata.schedule
    assert sched.cron_schedule.schedule == "0 3 * * *" and sched.kickoff_time_input_arg == "run_date"
    assert lp.spec.concurrency_policy.max == 1
    assert set(lp.spec.default_inputs.parameters) >= {"cfg", "train_files", "val_files", "model_name", "run_date"}
    assert any(n.endswith("workflows.ppo.ppo_pipeline_2.pb") for n in package)


@pytest.mark.parametrize("name", ["tasks.rollout.rollout", "tasks.update.ppo_update", "tasks.evaluate.evaluate",
                                  "tasks.segment.ppo_segment", "tasks.rollout.score_with_model",
                                  "tasks.evaluate.policy_score"])
def test_package_gpu_tasks(package, name):
    t = _task(package, name)
    assert _resources(t)["GPU"] == "1" and t.extended_resources.gpu_accelerator.device == "nvidia-h100"
    assert t.metadata.interruptible and t.metadata.retries.retries >= 1
    assert "/flyte-rlhf-gpu:" in t.container.image


@pytest.mark.parametrize("module, name", [("tasks.update", "ppo_update"), ("tasks.segment", "ppo_segment")])
def test_package_update_and_segment_run_under_torch_elastic(package, module, name):
    t = _task(package, f"{module}.{name}")
    assert t.type == "python-task"  # one node: torchrun inside a plain pod
    assert t.extended_resources.shared_memory.mount_path == "/dev/shm"
    assert list(t.container.args)[-4:] == ["task-module", module, "task-name", name]
    multi = _task(package, f"{module}.{name}_multinode")
    assert multi.type == "pytorch"
    elastic = multi.custom.fields["elasticConfig"].struct_value.fields
    assert elastic["rdzvBackend"].string_value == "c10d" and elastic["nprocPerNode"].number_value == 8


@pytest.mark.parametrize("name", ["tasks.data.sample_prompts", "tasks.rollout.score", "tasks.evaluate.decide",
                                  "tasks.data.prepare_dataset", "tasks.registry.register_model"])
def test_package_cpu_tasks_ask_for_cpus_only(package, name):
    t = _task(package, name)
    assert "GPU" not in _resources(t) and "CPU" in _resources(t)
    assert not t.extended_resources.HasField("gpu_accelerator")
    assert "/flyte-rlhf-cpu:" in t.container.image


def test_package_caches_the_dataset(package):
    t = _task(package, "tasks.data.prepare_dataset")
    assert t.metadata.discoverable and t.metadata.discovery_version == "1"
    assert not _task(package, "tasks.data.sample_prompts").metadata.discoverable


def _chromium() -> str | None:
    import shutil

    return next((p for p in map(shutil.which, ("chromium-headless-shell", "chromium", "chromium-browser")) if p), None)


def test_decide_deck_renders_in_headless_chromium(tmp_path):
    """The deck file Flyte writes for `decide`, opened in a real browser: the training tab is
    the one shown, its curves image is present and drawn, and the stop reason is on it."""
    import logging

    from flytekit.loggers import logger
    from PIL import Image

    from tasks.evaluate import decide

    decks: list[str] = []

    class DeckPaths(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if "flyte deck html to file://" in msg:
                decks.append(msg.split("file://", 1)[1].strip())

    handler, level = DeckPaths(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        hist = [{"step": float(i), "critic/score/mean": 0.1 * i, "actor/current_kl": 0.02 * i,
                 "actor/reward_kl_penalty_coeff": 0.001, "actor/pg_loss": -0.1, "critic/vf_loss": 0.2 / i,
                 "actor/entropy": 1.0 - 0.1 * i, "actor/pg_clipfrac": 0.05, "response_length/mean": 7.0,
                 "actor/grad_norm": 0.3} for i in range(1, 6)]
        state = RoundState(round=5, global_step=5, step_history=hist,
                           val_history=[{"round": 0.0, "step": 0.0, "score": 0.25}])
        out = decide(cfg=load_config(None, ["early_stop.kl_ceiling=0.05"]), state=state, steps=hist[-1:])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert out.stop and decks, "decide wrote no deck"
    assert _chromium(), "needs Debian's chromium-headless-shell (or chromium): `make setup-browser` installs it"
    url = f"file://{decks[-1]}"
    browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(browser + ["--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert 'class="training-curves"' in dom and "above the ceiling early_stop.kl_ceiling=0.05" in dom
    png_b64 = dom.split('class="training-curves"')[1].split("base64,")[1].split('"')[0]
    assert len(png_b64) > 10_000, "the curves image is empty"
    shot = tmp_path / "decide_deck.png"
    subprocess.run(browser + ["--window-size=1400,1100", f"--screenshot={shot}", url], capture_output=True,
                   timeout=120, check=True)
    img = Image.open(shot).convert("L")
    top = img.crop((0, 0, img.width, 60))  # the tab bar: "training" must be the open tab
    plot = img.crop((0, 150, img.width, 700))  # where the curves are drawn
    assert sum(1 for n in plot.histogram() if n) > 20 and len(set(top.histogram())) > 2
    print(f"deck screenshot: {shot}")


def test_cli_sweep_with_an_unknown_key_is_refused(tmp_path):
    """`ppo_sweep --sweep FILE` holds the sweep to its own keys, inside list entries too;
    a valid file keeps its values and types (ParamSpec entries included)."""
    from flytekit.interaction.click_types import JsonParamType

    from rlhf.config import ConfigError
    from sweeps.space import ParamSpec
    from sweeps.steps import SweepConfig

    def cli(value: str):
        return JsonParamType(SweepConfig).convert(value, None, None)

    yml = tmp_path / "sweep.yaml"
    yml.write_text("n_trials: 4\nstudy:\n  pruenr: none\n")
    with pytest.raises(ConfigError, match=r"'study\.pruenr'.*did you mean 'study\.pruner'\? Correct or remove"):
        cli(str(yml))
    with pytest.raises(ConfigError, match=r"'space\[1\]\.hgih'.*did you mean 'space\[1\]\.high'"):
        cli('{"space": [{"name": "actor.clip_ratio", "low": 0.1, "high": 0.3}, {"name": "actor.lr", "hgih": 1}]}')
    with pytest.raises(ConfigError, match=r"'n_trails'.*did you mean 'n_trials'"):
        cli('{"n_trails": 3}')
    ok = cli('{"n_trials": 3, "study": {"pruner": "none"}, "space": [{"name": "actor.clip_ratio", "low": 0.1, '
             '"high": 0.3}]}')
    assert ok.n_trials == 3 and ok.study.pruner == "none"
    assert ok.space == [ParamSpec("actor.clip_ratio", 0.1, 0.3)] and type(ok.space[0].low) is float


def test_sweep_literal_with_an_unknown_key_is_refused():
    import dataclasses

    import msgpack
    from flytekit import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Binary, Literal, Scalar

    from sweeps.steps import SweepConfig

    data = dataclasses.asdict(SweepConfig())
    data["space"][0]["lwo"] = 0.0
    lit = Literal(scalar=Scalar(binary=Binary(value=msgpack.dumps(data), tag="msgpack")))
    with pytest.raises(Exception, match=r"'space\[0\]\.lwo'.*did you mean 'space\[0\]\.low'"):
        TypeEngine.to_python_value(FlyteContextManager.current_context(), lit, SweepConfig)
    good = dataclasses.asdict(SweepConfig())
    lit = Literal(scalar=Scalar(binary=Binary(value=msgpack.dumps(good), tag="msgpack")))
    assert TypeEngine.to_python_value(FlyteContextManager.current_context(), lit, SweepConfig) == SweepConfig()


def _compiled_nodes(dynamic_task, **inputs) -> dict:
    """The nodes a `@dynamic` lays out for `inputs`, as on a cluster: task name -> node."""
    from flytekit import FlyteContextManager
    from flytekit.core.context_manager import ExecutionState

    ctx = FlyteContextManager.current_context()
    state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
    with FlyteContextManager.with_context(ctx.with_serialization_settings(_settings()).with_execution_state(state)) \
            as ctx:
        spec = dynamic_task.compile_into_workflow(ctx, dynamic_task._task_function, **inputs)
    tasks = {t.id.resource_type_name() + t.id.name: t for t in spec.tasks}
    return {n.task_node.reference_id.name: n for n in spec.nodes if n.task_node}, tasks


def _gpus(node) -> str:
    from flytekit.models.task import Resources

    return next(r.value for r in node.task_node.overrides.resources.requests if r.name == Resources.ResourceName.GPU)


def test_generation_and_reward_model_tasks_ask_for_what_they_use():
    """With vLLM over 2 GPUs, rollout, evaluate and score_policy ask for 2; with a reward
    model, the round scores in the GPU image on a GPU; the update asks for the run's ranks."""
    from flytekit.types.directory import FlyteDirectory

    from rlhf.data.arithmetic import make_arithmetic
    from tasks.evaluate import score_policy
    from workflows.ppo import ppo_round

    cfg = load_config(None, ["rollout.name=vllm", "rollout.tensor_model_parallel_size=2",
                             "trainer.n_gpus_per_node=4", "reward.model_path=/models/rm"])
    policy, table = FlyteDirectory(path="s3://bucket/policy"), make_arithmetic(4, seed=0)
    nodes, _ = _compiled_nodes(score_policy, cfg=cfg, policy=policy, val=table)
    assert _gpus(nodes["tasks.evaluate.policy_score"]) == "2"
    nodes, tasks = _compiled_nodes(ppo_round, cfg=cfg, train=table, val=table, base_model=policy, policy=policy,
                                   checkpoint=None, state=RoundState(), run_id="")
    assert _gpus(nodes["tasks.rollout.rollout"]) == "2" and _gpus(nodes["tasks.evaluate.evaluate"]) == "2"
    assert _gpus(nodes["tasks.update.ppo_update"]) == "4"
    assert "tasks.rollout.score" not in nodes
    scorer = next(t for name, t in tasks.items() if name.endswith("tasks.rollout.score_with_model"))
    assert "/flyte-rlhf-gpu:" in scorer.container.image
