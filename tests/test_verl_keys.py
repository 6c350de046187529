"""verl's own config keys on the command line, in YAML and through `pyflyte run --cfg`."""

import json

import pytest

from rlhf.config import ConfigError, PPOConfig, load_config, resolve_epochs, rounds_for_epochs
from rlhf.config.verl_keys import translate_keys, translate_tree

# verl's GSM8K PPO quickstart (docs/start/quickstart.rst of verl's main branch, 0.8.0.dev,
# the newest text published), only the paths changed.
QUICKSTART = """
data.train_files=/data/gsm8k/train.parquet data.val_files=/data/gsm8k/test.parquet data.train_batch_size=256
data.max_prompt_length=512 data.max_response_length=512
actor_rollout_ref.model.path=/models/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.4
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 critic.optim.lr=1e-5
critic.model.path=/models/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4 algorithm.kl_ctrl.kl_coef=0.001
trainer.logger=console trainer.val_before_train=False trainer.n_gpus_per_node=1
trainer.nnodes=1 trainer.save_freq=10 trainer.test_freq=10 trainer.total_epochs=15
""".split()

EXPECTED = {
    ("data", "train_files"): ["/data/gsm8k/train.parquet"], ("data", "val_files"): ["/data/gsm8k/test.parquet"],
    ("data", "train_batch_size"): 256, ("data", "max_prompt_length"): 512, ("data", "max_response_length"): 512,
    ("model", "path"): "/models/Qwen2.5-0.5B-Instruct", ("actor", "lr"): 1e-6, ("actor", "ppo_mini_batch_size"): 64,
    ("actor", "ppo_micro_batch_size_per_gpu"): 4, ("rollout", "name"): "vllm",
    ("rollout", "log_prob_micro_batch_size_per_gpu"): 8, ("rollout", "tensor_model_parallel_size"): 1,
    ("rollout", "gpu_memory_utilization"): 0.4, ("ref", "log_prob_micro_batch_size_per_gpu"): 4,
    ("critic", "lr"): 1e-5, ("model", "critic_path"): "/models/Qwen2.5-0.5B-Instruct",
    ("critic", "ppo_micro_batch_size_per_gpu"): 4, ("trainer", "logger"): ["console"],
    ("trainer", "val_before_train"): False, ("trainer", "n_gpus_per_node"): 1, ("trainer", "nnodes"): 1,
    ("trainer", "save_freq"): 10, ("trainer", "test_freq"): 10, ("trainer", "total_epochs"): 15,
}


def _get(cfg, section, key):
    return getattr(getattr(cfg, section), key)


def test_quickstart_overrides_map_onto_the_config():
    cfg = load_config(None, QUICKSTART)
    for (section, key), want in EXPECTED.items():
        assert _get(cfg, section, key) == want, (section, key)
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001


def test_quickstart_as_verl_nested_yaml(tmp_path):
    tree: dict = {}
    for text in QUICKSTART:
        key, value = text.split("=", 1)
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / "verl.yaml"
    import yaml

    path.write_text(yaml.safe_dump(tree))
    assert load_config(str(path)) == load_config(None, QUICKSTART)


def test_pyflyte_cfg_accepts_verl_keys():
    """`pyflyte run --cfg` builds the input with `PPOConfig.from_json` (and a cluster launch
    with mashumaro's `__pre_deserialize__`): both translate the verl keys."""
    tree = {"actor_rollout_ref": {"actor": {"optim": {"lr": 3e-6}, "ppo_mini_batch_size": 8},
                                  "rollout": {"n": 5}},
            "critic": {"optim": {"lr": 2e-5}}, "trainer": {"resume_mode": "disable"}}
    cfg = PPOConfig.from_json(json.dumps(tree))
    assert (cfg.actor.lr, cfg.actor.ppo_mini_batch_size, cfg.rollout.n, cfg.critic.lr, cfg.trainer.resume) == \
        (3e-6, 8, 5, 2e-5, "disable")
    assert PPOConfig.__pre_deserialize__(tree)["actor"]["lr"] == 3e-6


@pytest.mark.parametrize("override, words", [
    ("trainer.total_training_steps=100", "trainer.total_rounds"),
    ("actor_rollout_ref.actor.strategy=fsdp", "deepspeed.zero_stage"),
    ("critic.ppo_mini_batch_size=64", "actor.ppo_mini_batch_size"),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4", "no counterpart"),
    ("data.prompt_key=question", "'prompt'"),
])
def test_keys_without_counterpart_are_refused_with_the_reason(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert override.split("=")[0] in str(e.value) and words in str(e.value)


def test_critic_warmup_is_verls_key_and_meaning():
    """verl's `trainer.critic_warmup`: the first N PPO steps update only the critic."""
    assert load_config(None, ["trainer.critic_warmup=5"]).trainer.critic_warmup == 5
    assert PPOConfig.from_json(json.dumps({"trainer": {"critic_warmup": 5}})).trainer.critic_warmup == 5
    assert load_config(None, []).trainer.critic_warmup == 0  # verl's default: no warm-up


def test_fixed_value_at_its_default_is_accepted():
    assert load_config(None, ["data.prompt_key=prompt"]) == load_config(None, ["defaults=verl"])


def test_two_keys_for_one_setting_must_agree():
    with pytest.raises(ConfigError, match="both set 'actor.lr'"):
        translate_tree({"actor": {"lr": 1e-3}, "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}}})
    same, verl = translate_keys({"actor": {"lr": 1e-3}, "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-3}}}})
    assert (same, verl) == ({"actor": {"lr": 1e-3}}, True)
    assert translate_tree({"actor": {"lr": 1e-3}}) == {"actor": {"lr": 1e-3}}


def test_unknown_keys_still_get_the_closest_name():
    with pytest.raises(ConfigError, match="did you mean 'actor.clip_ratio'"):
        load_config(None, ["actor_rollout_ref.actor.ppo_epochs=2", "actor.clip_rato=0.3"])


def _verl_total_training_steps(n_rows: int, train_batch_size: int, total_epochs: int) -> int:
    """verl 0.9.1's step count, from its own lines: the statements of
    `verl/trainer/ppo/v1/trainer_base.py`'s `_init_dataloader` from `self.steps_per_epoch = ...`
    to `self.total_training_steps = ...`, run on a train set of `n_rows` rows (the loader
    itself needs torchdata and datasets, which verl's wheel is installed here without)."""
    import ast
    import importlib.util
    import logging
    from pathlib import Path
    from types import SimpleNamespace

    omegaconf = pytest.importorskip("omegaconf")
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("the installed verl 0.9.1 wheel (make setup-verl)")
    source = Path(spec.origin).parent / "trainer" / "ppo" / "v1" / "trainer_base.py"
    fn = next(n for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.FunctionDef)
              and n.name == "_init_dataloader")
    texts = [ast.unparse(s) for s in fn.body]
    first = next(i for i, t in enumerate(texts) if t.startswith("self.steps_per_epoch ="))
    last = next(i for i, t in enumerate(texts) if t.startswith("self.total_training_steps ="))
    module = ast.Module(body=fn.body[first:last + 1], type_ignores=[])
    config = omegaconf.OmegaConf.create({"data": {"train_batch_size": train_batch_size},
                                         "trainer": {"total_epochs": total_epochs, "total_training_steps": None}})
    trainer = SimpleNamespace(train_dataset=range(n_rows), config=config)
    exec(compile(module, str(source), "exec"), {"self": trainer, "logger": logging.getLogger("verl")})
    return trainer.total_training_steps


def test_total_epochs_counts_steps_as_verl_does():
    """`trainer.total_epochs=15` on GSM8K's 7,473 train rows at batch 256: verl's loader drops
    each epoch's last partial batch, 29 steps an epoch, 435 steps."""
    cfg = load_config(None, ["trainer.total_epochs=15", "data.train_batch_size=256", "actor.ppo_mini_batch_size=64"])
    verl_steps = _verl_total_training_steps(7473, 256, 15)
    assert verl_steps == 435
    assert rounds_for_epochs(cfg, 7473) == verl_steps
    resolved = resolve_epochs(cfg, 7473)
    assert (resolved.trainer.total_rounds, resolved.trainer.total_epochs) == (verl_steps, 0)
    assert resolve_epochs(resolved, 10) == resolved
    two_steps = load_config(None, ["trainer.total_epochs=2", "trainer.steps_per_round=2", "data.train_batch_size=8",
                                   "actor.ppo_mini_batch_size=8"])
    # 100 rows at 8 a step: 12 steps an epoch, 24 in all, 12 rounds of 2 steps
    assert rounds_for_epochs(two_steps, 100) == _verl_total_training_steps(100, 8, 2) // 2 == 12
    with pytest.raises(ConfigError, match="at least one full batch"):
        rounds_for_epochs(two_steps, 7)  # verl: "Train dataloader is empty"
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config(None, ["trainer.total_epochs=-1"])
