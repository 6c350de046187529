"""A launch in verl's key names takes verl 0.9.1's defaults, held key by key to verl's own
generated config (`verl/trainer/config/_generated_ppo_trainer.yaml` of the installed wheel).

Every leaf of the training sections of that file is accounted for here: compared with the
config a verl command line resolves to (`EQUAL`), built in here at verl's value and refused
at any other (`BUILT_IN`), deliberately different with the reason (`DIFFERENT`), or not a
training setting (`NOT_TRAINING`, by section)."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import yaml

from rlhf.config import ConfigError, PPOConfig, correction_settings, flatten, load_config, to_dict
from rlhf.config.load import from_dict

omegaconf = pytest.importorskip("omegaconf", reason="verl's config needs omegaconf (make setup-verl)")
_VERL = importlib.util.find_spec("verl")  # located, not imported: importing verl costs seconds
if _VERL is None:
    pytest.skip("the installed verl 0.9.1 wheel (make setup-verl)", allow_module_level=True)
GENERATED = Path(_VERL.origin).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
AR = "actor_rollout_ref"
LAUNCH = [f"{AR}.rollout.name=vllm"]  # the one key verl's yaml leaves mandatory

# verl key -> this project's key, compared as resolved (verl's `${...}` interpolations included).
EQUAL = {
    "data.train_batch_size": "data.train_batch_size", "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "data.max_response_length",
    "data.filter_overlong_prompts": "data.filter_overlong_prompts", "data.truncation": "data.truncation",
    "data.shuffle": "data.shuffle",
    f"{AR}.model.use_remove_padding": "data.use_sequence_packing",
    f"{AR}.actor.use_remove_padding": "data.use_sequence_packing",
    "critic.model.use_remove_padding": "data.use_sequence_packing",
    f"{AR}.model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
    "critic.model.enable_gradient_checkpointing": "critic.enable_gradient_checkpointing",
    **{f"{AR}.model.{k}": f"model.{k}" for k in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules")},
    **{f"critic.model.{k}": f"critic.{k}" for k in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules")},
    f"{AR}.model.trust_remote_code": "model.trust_remote_code",
    "critic.model.trust_remote_code": "model.trust_remote_code",
    f"{AR}.actor.optim.lr": "actor.lr", f"{AR}.actor.optim.weight_decay": "actor.weight_decay",
    f"{AR}.actor.optim.clip_grad": "actor.grad_clip",
    f"{AR}.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    f"{AR}.actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    f"{AR}.actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    f"{AR}.actor.ppo_epochs": "actor.ppo_epochs", f"{AR}.actor.shuffle": "actor.shuffle",
    f"{AR}.actor.clip_ratio": "actor.clip_ratio", f"{AR}.actor.clip_ratio_low": "actor.clip_ratio_low",
    f"{AR}.actor.clip_ratio_high": "actor.clip_ratio_high", f"{AR}.actor.clip_ratio_c": "actor.clip_ratio_c",
    f"{AR}.actor.loss_agg_mode": "actor.loss_agg_mode", f"{AR}.actor.entropy_coeff": "actor.entropy_coeff",
    f"{AR}.actor.use_kl_loss": "actor.use_kl_loss", f"{AR}.actor.kl_loss_coef": "actor.kl_loss_coef",
    f"{AR}.actor.kl_loss_type": "actor.kl_loss_type",
    f"{AR}.rollout.n": "rollout.n", f"{AR}.rollout.temperature": "rollout.temperature",
    f"{AR}.rollout.top_p": "rollout.top_p", f"{AR}.rollout.top_k": "rollout.top_k",
    f"{AR}.rollout.val_kwargs.temperature": "rollout.val_temperature",
    f"{AR}.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    f"{AR}.rollout.max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "critic.optim.lr": "critic.lr", "critic.optim.weight_decay": "critic.weight_decay",
    "critic.optim.clip_grad": "critic.grad_clip", "critic.cliprange_value": "critic.cliprange_value",
    "critic.ppo_epochs": "critic.ppo_epochs", "critic.loss_agg_mode": "critic.loss_agg_mode",
    "critic.use_dynamic_bsz": "actor.use_dynamic_bsz",  # the critic micro-batches as the actor does here
    "critic.ppo_mini_batch_size": "actor.ppo_mini_batch_size",  # the critic steps on the actor's mini-batches
    "critic.shuffle": "actor.shuffle",
    "algorithm.adv_estimator": "algorithm.adv_estimator", "algorithm.gamma": "algorithm.gamma",
    "algorithm.lam": "algorithm.lam", "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward": "algorithm.use_kl_in_reward", "algorithm.kl_penalty": "algorithm.kl_penalty",
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef": "algorithm.kl_ctrl.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_ctrl.target_kl",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_ctrl.horizon",
    "algorithm.rollout_correction.rollout_is": "algorithm.rollout_correction.rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_correction.rollout_is_threshold",
    "algorithm.rollout_correction.rollout_is_batch_normalize":
        "algorithm.rollout_correction.rollout_is_batch_normalize",
    "algorithm.rollout_correction.rollout_rs": "algorithm.rollout_correction.rollout_rs",
    "algorithm.rollout_correction.rollout_rs_threshold": "algorithm.rollout_correction.rollout_rs_threshold",
    "algorithm.rollout_correction.bypass_mode": "algorithm.rollout_correction.bypass_mode",
    "trainer.total_epochs": "trainer.total_epochs", "trainer.save_freq": "trainer.save_freq",
    "trainer.test_freq": "trainer.test_freq", "trainer.val_before_train": "trainer.val_before_train",
    "trainer.critic_warmup": "trainer.critic_warmup", "trainer.balance_batch": "trainer.balance_batch",
    "trainer.resume_mode": "trainer.resume", "trainer.nnodes": "trainer.nnodes",
}
# verl's null where this project spells the same meaning otherwise.
NULL_HERE = {"data.val_batch_size": ("data.val_batch_size", 0),  # the whole set in one batch
             "trainer.max_actor_ckpt_to_keep": ("trainer.max_ckpt_to_keep", 0),  # keep all
             "trainer.max_critic_ckpt_to_keep": ("trainer.max_ckpt_to_keep", 0),
             "trainer.rollout_data_dir": ("trainer.rollout_data_dir", "")}  # not written

# verl key -> a value it may not take here: the behaviour at verl's default is built in, any other is refused.
BUILT_IN = {
    f"{AR}.actor.optim.optimizer": "SGD", f"{AR}.actor.optim.optimizer_impl": "bitsandbytes.optim",
    f"{AR}.actor.optim.lr_warmup_steps_ratio": 0.1, f"{AR}.actor.optim.lr_warmup_steps": 10,
    f"{AR}.actor.optim.lr_scheduler_type": "cosine", f"{AR}.actor.optim.warmup_style": "cosine",
    f"{AR}.actor.optim.betas": [0.9, 0.95], f"{AR}.actor.optim.total_training_steps": 100,
    "critic.optim.optimizer": "SGD", "critic.optim.optimizer_impl": "bitsandbytes.optim",
    "critic.optim.lr_warmup_steps_ratio": 0.1, "critic.optim.lr_warmup_steps": 10,
    "critic.optim.lr_scheduler_type": "cosine", "critic.optim.warmup_style": "cosine",
    "critic.optim.betas": [0.9, 0.95], "critic.optim.total_training_steps": 100,
    f"{AR}.rollout.calculate_log_probs": False, "data.prompt_key": "question", "data.reward_fn_key": "source",
    "trainer.total_training_steps": 100, "trainer.resume_from_path": "/ckpt/global_step_10",
    "trainer.default_hdfs_dir": "hdfs://x/y", "data.tokenizer": "/other/tokenizer",
    f"{AR}.actor.policy_loss.loss_mode": "gspo",
    f"{AR}.actor.loss_scale_factor": 512, f"{AR}.actor.use_prefix_grouper": True,
    f"{AR}.rollout.do_sample": False, f"{AR}.rollout.ignore_eos": True, f"{AR}.rollout.over_sample_rate": 0.1,
    f"{AR}.rollout.logprobs_mode": "raw_logprobs", f"{AR}.rollout.val_kwargs.n": 4,
    f"{AR}.rollout.val_kwargs.do_sample": True, f"{AR}.rollout.val_kwargs.top_p": 0.9,
    f"{AR}.rollout.val_kwargs.top_k": 5,
    "critic.loss_scale_factor": 512, "algorithm.filter_groups.enable": True, "algorithm.use_pf_ppo": True,
    "data.train_max_samples": 100, "data.gen_batch_size": 64, "trainer.val_only": True,
    "trainer.validation_data_dir": "/tmp/val",
}

# verl key -> why this project's value differs on purpose.
DIFFERENT = {
    "data.train_files": "verl's is an example path (~/data/rlhf/gsm8k); unset here means the built-in synthetic task",
    "data.val_files": "as data.train_files",
    f"{AR}.model.path": "verl's is an example path (~/models/deepseek-llm-7b-chat); unset here means the tiny model "
                        "built in code",
    "critic.model.path": "as actor_rollout_ref.model.path (unset: the critic starts from the actor)",
    f"{AR}.rollout.name": "mandatory in verl ('???'); here hf when unset",
    f"{AR}.actor.ppo_micro_batch_size_per_gpu": "mandatory in verl unless use_dynamic_bsz; here 64 (capped at the "
                                                "per-GPU mini-batch): memory, not results",
    "critic.ppo_micro_batch_size_per_gpu": "as the actor's",
    f"{AR}.rollout.log_prob_micro_batch_size_per_gpu": "mandatory in verl; here the actor's micro-batch",
    f"{AR}.ref.log_prob_micro_batch_size_per_gpu": "mandatory in verl; here the actor's micro-batch",
    f"{AR}.rollout.tensor_model_parallel_size": "placement (verl assumes 2 GPUs per engine); here 1",
    "trainer.n_gpus_per_node": "the machine (verl assumes 8); here 1",
    "trainer.device": "the machine (verl: cuda); here auto",
    "trainer.logger": "a tracking sink, not training (verl adds wandb, which needs an account); here console",
    "trainer.project_name": "a name", "trainer.experiment_name": "a name",
    "trainer.default_local_dir": "a place (verl: checkpoints/<project>/<experiment>); here trainer.output_dir",
    f"{AR}.actor.data_loader_seed": "seeds: no implementation reproduces another's random streams; trainer.seed",
    "critic.data_loader_seed": "seeds: trainer.seed", "data.seed": "seeds: trainer.seed",
    f"{AR}.rollout.seed": "seeds: trainer.seed",
    f"{AR}.rollout.dtype": "precision follows the hardware here: deepspeed.bf16 / model.dtype",
    f"{AR}.actor.strategy": "DeepSpeed ZeRO here, not FSDP: refused, naming deepspeed.zero_stage, bf16, offload",
    "critic.strategy": "as actor_rollout_ref.actor.strategy",
    f"{AR}.rollout.mode": "rollout runs in the trainer's process or a colocated vLLM engine: refused (rollout.name)",
    f"{AR}.rollout.prompt_length": "an interpolation of data.max_prompt_length: refused, naming it",
    f"{AR}.rollout.response_length": "an interpolation of data.max_response_length: refused, naming it",
    f"{AR}.actor.grad_clip": "not read by verl 0.9.1 (actor_rollout_ref.actor.optim.clip_grad is): refused, naming it",
    "critic.grad_clip": "not read by verl 0.9.1 (critic.optim.clip_grad is): refused in a verl run, naming it",
    "critic.ppo_max_token_len_per_gpu": "the critic uses the actor's token budget (actor.ppo_max_token_len_per_gpu)",
    "critic.forward_max_token_len_per_gpu": "the critic uses the actor's token budget",
}

# verl sections or keys that hold no training setting (engines, placement, speed, multimodal, tools, infra).
NOT_TRAINING = (
    "_target_", f"{AR}.actor.rollout_n", f"{AR}.ref.rollout_n", "critic.rollout_n",  # copies of rollout.n
    f"{AR}.actor.optim.min_lr_ratio", f"{AR}.actor.optim.num_cycles", f"{AR}.actor.optim.zero_indexed_step",
    f"{AR}.actor.optim.override_optimizer_config", "critic.optim.min_lr_ratio", "critic.optim.num_cycles",
    "critic.optim.zero_indexed_step", "critic.optim.override_optimizer_config",  # schedules other than constant
    f"{AR}.actor.policy_loss.", f"{AR}.actor.tau_", f"{AR}.actor.freeze_vision_tower",  # other loss modes, VLMs
    f"{AR}.actor.ppo_micro_batch_size", "critic.ppo_micro_batch_size", f"{AR}.rollout.log_prob_micro_batch_size",
    f"{AR}.ref.log_prob_micro_batch_size", "critic.forward_micro_batch_size",  # deprecated global micro sizes
    f"{AR}.actor.calculate_sum_pi_squared", f"{AR}.actor.calculate_entropy", "data.return_raw_chat",
    "trainer.log_val_generations", f"{AR}.actor.use_torch_compile", f"{AR}.actor.use_fused_kernels",
    f"{AR}.actor.ulysses_", f"{AR}.actor.entropy_", f"{AR}.actor.pad_to_length", f"{AR}.ref.",
    "critic.ulysses_", "critic.enable", f"{AR}.rollout.mode", f"{AR}.rollout.nnodes",
    f"{AR}.rollout.n_gpus_per_node", f"{AR}.rollout.full_determinism", f"{AR}.rollout.enforce_eager",
    f"{AR}.rollout.cudagraph_capture_sizes", f"{AR}.rollout.free_cache_engine", f"{AR}.rollout.data_parallel_size",
    f"{AR}.rollout.expert_parallel_size", f"{AR}.rollout.pipeline_model_parallel_size",
    f"{AR}.rollout.max_model_len", f"{AR}.rollout.max_num_seqs", f"{AR}.rollout.enable_",
    f"{AR}.rollout.scheduling_policy", f"{AR}.rollout.load_format", f"{AR}.rollout.layered_summon",
    f"{AR}.rollout.log_prob_use_dynamic_bsz", f"{AR}.rollout.log_prob_max_token_len_per_gpu",
    f"{AR}.rollout.disable_log_stats", f"{AR}.rollout.multi_stage_wake_up", f"{AR}.rollout.router_config_path",
    f"{AR}.rollout.skip_tokenizer_init", f"{AR}.rollout.moe_", f"{AR}.rollout.quantization", f"{AR}.rollout.mtp",
    f"{AR}.rollout.qat", f"{AR}.model.hf_config_path", f"{AR}.model.tokenizer_path", f"{AR}.model.use_shm",
    f"{AR}.model.custom_chat_template", f"{AR}.model.external_lib", f"{AR}.model.enable_activation_offload",
    f"{AR}.model.lora_adapter_path", f"{AR}.model.use_liger", f"{AR}.model.use_fused_kernels",
    "critic.model.hf_config_path", "critic.model.tokenizer_path", "critic.model.use_shm",
    "critic.model.custom_chat_template", "critic.model.external_lib", "critic.model.enable_activation_offload",
    "critic.model.lora_adapter_path", "critic.model.use_liger", "critic.model.use_fused_kernels",
    "data.use_shm", "data.val_max_samples", "data.tool_config_path", "data.function_tool_path",
    "data.return_raw_input_ids", "data.return_full_prompt", "data.dataloader_num_workers", "data.image_",
    "data.validation_shuffle", "data.filter_overlong_prompts_workers", "data.video_key", "data.audio_key",
    "data.trust_remote_code", "data.return_multi_modal_inputs",
    "algorithm.filter_groups.metric", "algorithm.filter_groups.max_", "algorithm.pf_ppo.",  # only when enabled
    "algorithm.rollout_correction.loss_type",  # rollout correction's own keys: docs/VERL.md, Rollout correction
    "trainer.esi_redundant_time", "trainer.checkpoint_callback_class", "trainer.del_local_ckpt_after_load",
    "trainer.ray_wait_register_center_timeout", "trainer.use_v1",
)
SECTIONS = (f"{AR}.actor", f"{AR}.rollout", f"{AR}.model", f"{AR}.ref", "data", "critic", "algorithm", "trainer")
SKIP = ("profiler", "checkpoint", "fsdp_config", "fsdp", "qat", "multi_turn", "agent", "trace", "prometheus",
        "checkpoint_engine", "engine_kwargs", "disaggregation", "lora", "mtp", "tiled_mlp", "fused_kernel_options",
        "override_config", "turbo_config", "v1", "custom_cls")  # engine, profiling and infrastructure sections


@pytest.fixture(scope="module")
def generated():
    return omegaconf.OmegaConf.load(GENERATED)


def _verl(generated, key):
    return omegaconf.OmegaConf.select(generated, key, throw_on_missing=False)


def _leaf_keys(node, prefix):
    out = []
    for k in node.keys():
        child, key = node._get_node(k), f"{prefix}.{k}"
        if omegaconf.OmegaConf.is_dict(child):
            out += [] if k in SKIP else _leaf_keys(child, key)
        else:
            out.append(key)
    return out


def test_every_training_default_of_verl_is_accounted_for(generated):
    leaves = [k for s in SECTIONS for k in _leaf_keys(_verl(generated, s), s)]
    assert len(leaves) > 250, "verl's generated config was not read"
    known = set(EQUAL) | set(NULL_HERE) | set(BUILT_IN) | set(DIFFERENT)
    loose = [k for k in leaves if k not in known and not any(k.startswith(p) or k.endswith(p) for p in NOT_TRAINING)]
    assert loose == [], f"verl keys neither compared nor listed with a reason: {loose}"


def _same_value(verl_value, ours) -> bool:
    """Equal, or a threshold this project keeps as the text verl's value is written as
    (rollout_is_threshold is a number or a 'lower_upper' string in verl)."""
    if isinstance(ours, str) and isinstance(verl_value, (int, float)) and not isinstance(verl_value, bool):
        return float(ours) == float(verl_value)
    if isinstance(ours, list) and isinstance(verl_value, str):  # target_modules: one name or all-linear
        return ours == [verl_value]
    return ours == verl_value


def test_a_verl_launch_resolves_to_verls_defaults_key_by_key(generated):
    flat = flatten(load_config(None, LAUNCH))
    assert flat["defaults"] == "verl"
    wrong = {v: (_verl(generated, v), flat[ours]) for v, ours in EQUAL.items()
             if not _same_value(_verl(generated, v), flat[ours])}
    assert wrong == {}, f"verl key: (verl's default, this project's value): {wrong}"
    for v, (ours, meaning) in NULL_HERE.items():
        assert _verl(generated, v) is None and flat[ours] == meaning, v


@pytest.mark.parametrize("key", sorted(BUILT_IN))
def test_verl_keys_built_in_here_accept_verls_default_and_refuse_another(generated, key):
    default = _verl(generated, key)
    default = omegaconf.OmegaConf.to_object(default) if omegaconf.OmegaConf.is_list(default) else default
    assert load_config(None, [*LAUNCH, f"{key}={json.dumps(default)}"]) == load_config(None, LAUNCH)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [*LAUNCH, f"{key}={json.dumps(BUILT_IN[key])}"])


def test_a_launch_in_this_projects_names_keeps_its_defaults():
    cfg = load_config(None, ["actor.lr=1e-3", "data.train_batch_size=32"])
    assert cfg.defaults == "project"
    assert cfg == from_dict({"actor": {"lr": 1e-3}, "data": {"train_batch_size": 32}})
    assert flatten(cfg) == {**flatten(PPOConfig()), "actor.lr": 1e-3, "data.train_batch_size": 32}
    chosen = load_config(None, ["defaults=verl"])  # verl's defaults asked for by name
    assert chosen.rollout.n == 1 and flatten(chosen) == {**flatten(load_config(None, LAUNCH)), "rollout.name": "hf"}


def test_explicit_keys_win_and_defaults_project_opts_out():
    cfg = load_config(None, [*LAUNCH, "data.train_batch_size=64", f"{AR}.rollout.n=4", "actor.ppo_epochs=2"])
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.critic.ppo_epochs) == (64, 4, 2)  # critic follows the actor
    assert cfg.actor.ppo_mini_batch_size == 256 and cfg.algorithm.use_kl_in_reward is False
    mine = load_config(None, [*LAUNCH, "defaults=project"])
    assert mine.defaults == "project" and mine.rollout.n == PPOConfig().rollout.n
    counted = load_config(None, [*LAUNCH, "trainer.total_rounds=7"])
    assert (counted.trainer.total_rounds, counted.trainer.total_epochs) == (7, 0)  # rounds win over verl's 30 epochs
    for setting in ("algorithm.rollout_correction.preset=decoupled_seq_is", "actor.tis_imp_ratio_cap=3.0"):
        rc = correction_settings(load_config(None, [*LAUNCH, setting]))  # the setting is the whole correction
        assert rc.rollout_is in ("sequence", "token"), setting


def test_the_choice_is_recorded_and_a_saved_config_reloads_as_the_same_run(tmp_path):
    cfg = load_config(None, LAUNCH)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_config(str(path)) == cfg
    tree = {AR: {"rollout": {"name": "vllm"}}}
    assert PPOConfig.from_json(json.dumps(tree)) == cfg  # pyflyte run --cfg: the same defaults


def test_critic_grad_clip_is_refused_in_a_verl_run_and_clip_grad_is_the_clip():
    with pytest.raises(ConfigError, match="critic.optim.clip_grad"):
        load_config(None, [*LAUNCH, "critic.grad_clip=0.5"])
    cfg = load_config(None, [*LAUNCH, "critic.optim.clip_grad=0.5", f"{AR}.actor.optim.clip_grad=0.3"])
    assert (cfg.critic.grad_clip, cfg.actor.grad_clip) == (0.5, 0.3)
    assert load_config(None, ["critic.grad_clip=0.5"]).critic.grad_clip == 0.5  # this project's key, its defaults


def test_clip_ratio_alone_is_flagged_in_a_verl_run(caplog):
    """verl's clip_ratio_low/high (0.2) win over clip_ratio in `compute_policy_loss_vanilla`."""
    with caplog.at_level(logging.WARNING, logger="rlhf.config.verl_defaults"):
        cfg = load_config(None, [*LAUNCH, f"{AR}.actor.clip_ratio=0.3"])
    assert (cfg.actor.clip_ratio, cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.3, 0.2, 0.2)
    assert "clip_ratio_low and clip_ratio_high default to 0.2" in caplog.text


def test_two_spellings_of_one_key_must_agree_on_the_command_line():
    with pytest.raises(ConfigError, match="both set 'actor.lr'"):
        load_config(None, ["actor.lr=1e-3", f"{AR}.actor.optim.lr=1e-6"])
    assert load_config(None, ["actor.lr=1e-3", "actor.lr=2e-3"]).actor.lr == 2e-3  # one key twice: the last wins
