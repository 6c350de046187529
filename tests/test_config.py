import dataclasses
import json

import pytest

from rlhf.config import (ConfigError, PPOConfig, all_keys, derive_sizes, flatten, load_config, parse_override,
                         replace)

DESIGN_KEYS = [
    "data.train_batch_size", "data.max_prompt_length", "data.max_response_length", "data.use_sequence_packing",
    "actor.clip_ratio", "actor.entropy_coeff", "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size_per_gpu",
    "actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu", "actor.grad_clip", "actor.use_kl_loss",
    "rollout.name", "rollout.n", "rollout.tensor_model_parallel_size", "rollout.gpu_memory_utilization",
    "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon",
    "algorithm.kl_penalty", "algorithm.use_kl_in_reward", "algorithm.adv_estimator", "algorithm.gamma",
    "algorithm.lam", "trainer.total_rounds", "trainer.steps_per_round", "trainer.test_freq", "trainer.logger",
    "trainer.n_gpus_per_node", "trainer.nnodes", "deepspeed.zero_stage", "deepspeed.bf16", "deepspeed.offload",
]


def test_verl_key_names_exist():
    keys = set(all_keys())
    assert not [k for k in DESIGN_KEYS if k not in keys]
    assert any(k.startswith("early_stop.") for k in keys)


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("actor:\n  clip_ratio: 0.3\nalgorithm:\n  kl_ctrl: {type: adaptive, kl_coef: 0.01}\n")
    cfg = load_config(p, ["rollout.n=8", "algorithm.kl_ctrl.kl_coef=1e-3", "trainer.logger=[console,mlflow]",
                          "data.use_sequence_packing=true"])
    assert cfg.actor.clip_ratio == 0.3
    assert cfg.algorithm.kl_ctrl.type == "adaptive"
    assert cfg.algorithm.kl_ctrl.kl_coef == pytest.approx(1e-3)
    assert cfg.rollout.n == 8
    assert cfg.trainer.logger == ["console", "mlflow"]
    assert cfg.data.use_sequence_packing is True


def test_json_config(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"rollout": {"n": 2}}))
    assert load_config(p).rollout.n == 2


def test_unknown_key_suggests_closest(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'actor.clip_ratio'"):
        load_config(None, ["actor.clip_ration=0.3"])
    p = tmp_path / "c.yaml"
    p.write_text("algorithm:\n  kl_ctrl:\n    kl_coeff: 0.1\n")
    with pytest.raises(ConfigError, match=r"c.yaml.*algorithm.kl_ctrl.kl_coeff.*algorithm.kl_ctrl.kl_coef"):
        load_config(p)


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="rollout.n"):
        load_config(None, ["rollout.n=abc"])
    with pytest.raises(ConfigError, match="rollout.name.*hf, hf_fast, vllm"):
        load_config(None, ["rollout.name=sglang"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("actor.clip_ratio")


def test_frozen_and_replace_leaves_original():
    cfg = PPOConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.clip_ratio = 0.5  # type: ignore[misc]
    new = replace(cfg, ["actor.clip_ratio=0.25"])
    assert new.actor.clip_ratio == 0.25 and cfg.actor.clip_ratio == 0.2
    assert flatten(new)["actor.clip_ratio"] == 0.25


def test_derive_sizes():
    cfg = load_config(None, ["data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "rollout.n=4",
                             "actor.ppo_micro_batch_size_per_gpu=4", "trainer.steps_per_round=3"])
    s = derive_sizes(cfg, world_size=2)
    assert (s.responses_per_step, s.num_mini_batches, s.mini_batch_per_gpu, s.grad_accum_steps) == (64, 2, 16, 4)
    assert s.responses_per_round == 192 and s.responses_per_gpu == 32


@pytest.mark.parametrize("overrides,world,match", [
    (["data.train_batch_size=10", "actor.ppo_mini_batch_size=4"], 1, "must divide data.train_batch_size"),
    (["data.train_batch_size=6", "actor.ppo_mini_batch_size=3", "rollout.n=1"], 2, "divisible by the number of GPUs"),
    (["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=1",
      "actor.ppo_micro_batch_size_per_gpu=3"], 1, "must divide the per-GPU mini-batch"),
    (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=10"], 1, "must hold one full sequence"),
])
def test_derive_sizes_errors(overrides, world, match):
    with pytest.raises(ConfigError, match=match):
        derive_sizes(load_config(None, overrides), world)


def test_config_choices_resolve_in_registries():
    from rlhf import algos
    from rlhf.config.schema import _CHOICES

    for kind in _CHOICES["algorithm.kl_penalty"]:
        assert kind in algos.KL_ESTIMATORS
    for name in _CHOICES["algorithm.adv_estimator"]:
        assert name in algos.ADV_ESTIMATORS
    for name in _CHOICES["algorithm.kl_ctrl.type"]:
        assert name in algos.KL_CONTROLLERS
    # token-sum (verl's sum over the global batch's tokens) is not offered: the update weights each
    # micro-batch's loss by its share of the mini-batch's rows, which a sum does not survive.
    assert set(_CHOICES["actor.loss_agg_mode"]) == set(algos.LOSS_AGG_MODES) - {"token-sum"}
