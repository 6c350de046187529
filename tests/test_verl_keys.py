"""verl's own config keys on the command line, in YAML and through `pyflyte run --cfg`."""

import json

import pytest

from rlhf.config import ConfigError, PPOConfig, load_config, resolve_epochs, rounds_for_epochs
from rlhf.config.verl_keys import translate_tree

# verl's GSM8K PPO quickstart (docs/start/quickstart.rst), only the paths changed.
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
    ("data", "train_files"): "/data/gsm8k/train.parquet", ("data", "val_files"): "/data/gsm8k/test.parquet",
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
    assert load_config(None, ["data.prompt_key=prompt"]) == load_config(None, [])


def test_two_keys_for_one_setting_must_agree():
    with pytest.raises(ConfigError, match="both set 'actor.lr'"):
        translate_tree({"actor": {"lr": 1e-3}, "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}}})
    same = translate_tree({"actor": {"lr": 1e-3}, "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-3}}}})
    assert same == {"actor": {"lr": 1e-3}}


def test_unknown_keys_still_get_the_closest_name():
    with pytest.raises(ConfigError, match="did you mean 'actor.clip_ratio'"):
        load_config(None, ["actor_rollout_ref.actor.ppo_epochs=2", "actor.clip_rato=0.3"])


def test_total_epochs_becomes_rounds_from_the_train_set_size():
    cfg = load_config(None, ["trainer.total_epochs=15", "data.train_batch_size=256", "actor.ppo_mini_batch_size=64"])
    assert rounds_for_epochs(cfg, 7473) == 438  # ceil(15 * 7473 / 256): verl's GSM8K train split
    resolved = resolve_epochs(cfg, 7473)
    assert (resolved.trainer.total_rounds, resolved.trainer.total_epochs) == (438, 0)
    assert resolve_epochs(resolved, 10) == resolved
    two_steps = load_config(None, ["trainer.total_epochs=2", "trainer.steps_per_round=2", "data.train_batch_size=8",
                                   "actor.ppo_mini_batch_size=8"])
    assert rounds_for_epochs(two_steps, 100) == 13  # ceil(2 * 100 / 16)
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config(None, ["trainer.total_epochs=-1"])
