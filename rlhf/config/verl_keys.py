"""verl's own config keys, with their full names, mapped onto `PPOConfig`.

A verl user's command line (`actor_rollout_ref.actor.ppo_mini_batch_size=64`,
`critic.optim.lr=1e-5`, `trainer.total_epochs=15`, ...) or a YAML file written in verl's
nesting (`actor_rollout_ref: {actor: {optim: {lr: ...}}}`) is translated here, before the
key check, by `translate_tree` (a nested mapping) and `translate_override` (one dotted
key). Keys that are already this project's keep their meaning; verl keys with a
counterpart are renamed (`VERL_KEYS`); verl keys without one raise `ConfigError` with the
reason (`REFUSED`, where verl's null, which sets nothing, passes; or a generic reason for
anything else under a verl-only section); keys whose only accepted values are the
behaviour built in here (`FIXED`) pass with those values and raise with any other; a null
where verl means "the default" becomes this project's spelling of it (`NULL_MEANS`).
A launch that uses any of these names takes verl 0.9.1's defaults for the keys it leaves
unset (`rlhf.config.verl_defaults`, applied by the callers: `rlhf.config.load`, and
`rlhf.config.keys` for flytekit's decoding). docs/VERL.md lists the same tables for people.
"""

from __future__ import annotations

from typing import Any

from rlhf.config.schema import ConfigError, PPOConfig, _sections, all_keys, get_dotted

_AR = "actor_rollout_ref"

# verl key -> this project's key.
VERL_KEYS: dict[str, str] = {
    f"{_AR}.model.path": "model.path",
    f"{_AR}.model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
    f"{_AR}.model.trust_remote_code": "model.trust_remote_code",
    f"{_AR}.model.use_remove_padding": "data.use_sequence_packing",
    f"{_AR}.actor.optim.lr": "actor.lr",
    f"{_AR}.actor.optim.weight_decay": "actor.weight_decay",
    f"{_AR}.actor.optim.clip_grad": "actor.grad_clip",
    f"{_AR}.actor.optim.grad_clip": "actor.grad_clip",  # verl's deprecated spelling of optim.clip_grad
    **{f"{_AR}.actor.{k}": f"actor.{k}" for k in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff",
        "loss_agg_mode", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "shuffle")},
    **{f"{_AR}.rollout.{k}": f"rollout.{k}" for k in (
        "name", "n", "temperature", "top_p", "top_k", "tensor_model_parallel_size", "gpu_memory_utilization",
        "max_num_batched_tokens", "log_prob_micro_batch_size_per_gpu", "free_cache_engine", "enforce_eager",
        "max_num_seqs")},
    f"{_AR}.rollout.val_kwargs.temperature": "rollout.val_temperature",
    f"{_AR}.ref.log_prob_micro_batch_size_per_gpu": "ref.log_prob_micro_batch_size_per_gpu",
    "critic.optim.lr": "critic.lr",
    "critic.optim.weight_decay": "critic.weight_decay",
    "critic.optim.clip_grad": "critic.grad_clip",
    "critic.optim.grad_clip": "critic.grad_clip",
    "critic.model.path": "model.critic_path",
    "critic.model.enable_gradient_checkpointing": "critic.enable_gradient_checkpointing",
    # One packing switch for both models here: packing is exact, so it changes memory and speed, not results.
    "critic.model.use_remove_padding": "data.use_sequence_packing",
    "critic.model.trust_remote_code": "model.trust_remote_code",
    "reward_model.model.path": "reward.model_path",
    "reward_model.micro_batch_size_per_gpu": "reward.model_batch_size",
    "trainer.resume_mode": "trainer.resume",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    **{f"{_AR}.model.{k}": f"model.{k}" for k in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules")},
    **{f"critic.model.{k}": f"critic.{k}" for k in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules")},
}

_SECTIONS_ONLY_IN_VERL = (f"{_AR}.", "reward_model.", "custom_reward_function.", "ray_init.", "ray_kwargs.",
                          "global_profiler.", "critic.model.", "critic.optim.")

_RC = "algorithm.rollout_correction"
# Rollout-correction keys of earlier verl releases (and of this project's earlier schema) that
# verl 0.9.1 no longer has: Hydra refuses them there, so they are refused here, with the new spelling.
_OLDER_CORRECTION_KEYS: dict[str, str] = {
    "algorithm.rollout_is": f"verl 0.9.1 moved it to {_RC}.rollout_is (token, sequence or null)",
    "algorithm.rollout_is_threshold": f"verl 0.9.1 moved it to {_RC}.rollout_is_threshold",
    "algorithm.rollout_is_threshold_lower": f"verl 0.9.1 writes both bounds in {_RC}.rollout_is_threshold "
                                            "as a quoted 'lower_upper' (IcePop)",
    "algorithm.rollout_is_level": f"verl 0.9.1 sets the level with {_RC}.rollout_is (token or sequence) and "
                                  f"rejection with {_RC}.rollout_rs (e.g. seq_mean_k1 for the former geometric level)",
    "algorithm.rollout_is_mode": f"verl 0.9.1 has no mode: {_RC}.rollout_is_threshold truncates (a number), "
                                 f"zeroes outside bounds ('lower_upper'), and {_RC}.rollout_rs rejects",
    "algorithm.rollout_is_veto_threshold": f"verl 0.9.1 has no veto; {_RC}.rollout_rs=seq_max_k2 or seq_max_k3 "
                                           "drops a response by its most divergent token",
    f"{_RC}.rollout_token_veto_threshold": f"verl 0.9.1 has no veto; {_RC}.rollout_rs=seq_max_k2 or seq_max_k3 "
                                           "drops a response by its most divergent token",
    f"{_RC}.rollout_rs_threshold_lower": f"verl 0.9.1 writes both bounds in {_RC}.rollout_rs_threshold as a "
                                         "quoted 'lower_upper' (k1 criteria)",
    f"{_AR}.actor.tis_imp_ratio_cap": f"verl 0.9.1 has no such key; set {_RC}.rollout_is=token and "
                                      f"{_RC}.rollout_is_threshold=<cap> (this project's actor.tis_imp_ratio_cap "
                                      "means the same)",
}

# verl key -> why it has no counterpart here (and what to set instead).
REFUSED: dict[str, str] = {
    "trainer.total_training_steps": "this project counts rounds: set trainer.total_rounds (steps = rounds x "
                                    "trainer.steps_per_round) or trainer.total_epochs",
    "trainer.resume_from_path": "resume reads the latest checkpoint under trainer.output_dir "
                                "(trainer.resume=auto); point trainer.output_dir at the run to continue",
    "trainer.default_hdfs_dir": "checkpoints are written under trainer.output_dir (a Flyte run moves them as "
                                "FlyteDirectory outputs)",
    "trainer.max_critic_ckpt_to_keep": "actor and critic are kept together: set trainer.max_ckpt_to_keep",
    f"{_AR}.actor.strategy": "the update runs on DeepSpeed ZeRO, not FSDP: set deepspeed.zero_stage, "
                             "deepspeed.bf16 and deepspeed.offload",
    "critic.strategy": "the update runs on DeepSpeed ZeRO, not FSDP: set deepspeed.zero_stage",
    f"{_AR}.actor.fsdp_config.param_offload": "DeepSpeed offload is one switch: set deepspeed.offload",
    f"{_AR}.actor.fsdp_config.optimizer_offload": "DeepSpeed offload is one switch: set deepspeed.offload",
    f"{_AR}.ref.fsdp_config.param_offload": "the reference shares the actor's placement here",
    "critic.ppo_mini_batch_size": "the critic steps on the actor's mini-batches: set "
                                  "actor_rollout_ref.actor.ppo_mini_batch_size (actor.ppo_mini_batch_size)",
    **{f"critic.{k}": f"the critic follows the actor's setting here: set actor_rollout_ref.actor.{a}"
       for k, a in (("use_dynamic_bsz", "use_dynamic_bsz"), ("shuffle", "shuffle"),
                    ("ppo_max_token_len_per_gpu", "ppo_max_token_len_per_gpu"),
                    ("forward_max_token_len_per_gpu", "ppo_max_token_len_per_gpu"),
                    ("forward_micro_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu (critic.ppo_micro_batch_size_per_gpu "
                                                         "sets the critic's)"))},
    f"{_AR}.actor.grad_clip": "verl 0.9.1 does not read it (the actor's clip norm is "
                              "actor_rollout_ref.actor.optim.clip_grad, default 1.0); set that",
    **{f"algorithm.{k}": "verl 0.9.1 has no such key: its rollout correction is algorithm.rollout_correction.* "
                         "(docs/VERL.md, Rollout correction)"
       for k in ("rollout_is", "rollout_is_threshold", "rollout_is_threshold_lower", "rollout_is_level",
                 "rollout_is_mode", "rollout_is_veto_threshold")},
    f"{_AR}.rollout.mode": "rollout runs in the trainer's process (hf, hf_fast) or a colocated vLLM engine; "
                           "choose rollout.name",
    f"{_AR}.rollout.response_length": "set data.max_response_length",
    f"{_AR}.rollout.prompt_length": "set data.max_prompt_length",
    "data.custom_cls.path": "datasets are parquet files in verl's layout; no custom dataset class is loaded",
    "data.tokenizer": "the tokenizer is the one saved beside the policy (model.path)",
    **_OLDER_CORRECTION_KEYS,
    f"{_AR}.model.lora_adapter_path": "training does not start from saved adapters: a LoRA run resumes from its own "
                                      "checkpoint (trainer.resume); to start from other adapters, merge them into a "
                                      "model directory and set model.path",
    "critic.model.lora_adapter_path": "training does not start from saved adapters: a LoRA run resumes from its own "
                                      "checkpoint (trainer.resume)",
}

_ANY = object()  # FIXED: every value accepted (the key changes nothing here)
_CONSTANT_LR = "the PPO learning rate is constant here, with AdamW (betas 0.9, 0.999): verl's defaults"

# verl key -> (the values accepted, the reason any other is refused).
FIXED: dict[str, tuple[tuple[Any, ...], str]] = {
    "data.prompt_key": (("prompt",), "the prompt column is always 'prompt' (verl's default)"),
    "data.reward_fn_key": (("data_source",), "the reward function is chosen by 'data_source' (verl's default)"),
    f"{_AR}.hybrid_engine": ((True,), "rollout and update always share the process and the GPUs here"),
    f"{_AR}.rollout.calculate_log_probs": ((True,), "the rollout's log-probs are always kept here; to train "
                                                     "without rollout correction set "
                                                     "algorithm.rollout_correction.preset=disabled"),
    "reward_model.enable": ((_ANY,), ""),  # a reward model is used where rows ask for one
    # verl's defaults that are this project's only behaviour: accepted at that value.
    f"{_AR}.actor.policy_loss.loss_mode": (("vanilla",), "the policy loss is PPO's clipped loss (verl's vanilla)"),
    f"{_AR}.actor.loss_scale_factor": ((None,), "losses are aggregated by actor.loss_agg_mode alone"),
    "critic.loss_scale_factor": ((None,), "losses are aggregated by critic.loss_agg_mode alone"),
    f"{_AR}.actor.use_prefix_grouper": ((False,), "no prefix grouping"),
    f"{_AR}.model.use_shm": ((False,), "models load from their local directory; there is no shared-memory copy"),
    "critic.model.use_shm": ((False,), "models load from their local directory; there is no shared-memory copy"),
    f"{_AR}.rollout.layered_summon": ((False,), "the LoRA-merged weights a rollout engine gets are built from one "
                                                "gathered state dict (DeepSpeed, not FSDP): nothing to summon per layer"),
    f"{_AR}.actor.checkpoint.save_lora_only": ((True,), "a LoRA run's checkpoints hold its adapters only (and the key "
                                                        "does nothing without LoRA, as in verl); trainer.save_merged "
                                                        "writes the merged model"),
    f"{_AR}.rollout.do_sample": ((True,), "training rollouts sample (rollout.temperature)"),
    f"{_AR}.rollout.ignore_eos": ((False,), "generation stops at EOS"),
    f"{_AR}.rollout.over_sample_rate": ((0, 0.0), "every sampled response is kept"),
    f"{_AR}.rollout.logprobs_mode": (("processed_logprobs",), "rollout log-probs are of the sampling "
                                                              "distribution (after temperature)"),
    f"{_AR}.rollout.val_kwargs.n": ((1,), "one validation response per prompt"),
    f"{_AR}.rollout.val_kwargs.do_sample": ((False,), "validation decodes at rollout.val_temperature (0: greedy)"),
    f"{_AR}.rollout.val_kwargs.top_p": ((1, 1.0), "validation samples from the full distribution"),
    f"{_AR}.rollout.val_kwargs.top_k": ((-1,), "validation samples from the full distribution"),
    "algorithm.filter_groups.enable": ((False,), "no DAPO group filtering"),
    "algorithm.use_pf_ppo": ((False,), "no PF-PPO reweighting"),
    "data.train_max_samples": ((-1,), "every train row is used"),
    "data.gen_batch_size": ((None,), "a step generates for data.train_batch_size prompts"),
    "trainer.val_only": ((False,), "a launch trains; trainer.val_before_train validates the starting policy first"),
    "trainer.validation_data_dir": ((None,), "validation samples go to the tracker as an artifact"),
    # verl switches with no effect on training here: any value.
    f"{_AR}.actor.calculate_entropy": ((_ANY,), ""),  # the entropy is always measured
    "data.return_raw_chat": ((_ANY,), ""),
    "trainer.log_val_generations": ((_ANY,), ""),
    **{f"{opt}.{k}": (values, _CONSTANT_LR) for opt in (f"{_AR}.actor.optim", "critic.optim")
       for k, values in (("lr_warmup_steps_ratio", (0, 0.0)), ("lr_warmup_steps", (-1, 0)),
                         ("warmup_style", (None, "constant")), ("lr_scheduler_type", ("constant",)),
                         ("optimizer", ("AdamW",)), ("optimizer_impl", ("torch.optim",)),
                         ("betas", ([0.9, 0.999],)), ("min_lr_ratio", (_ANY,)), ("num_cycles", (_ANY,)),
                         ("total_training_steps", (-1, None)))},
}

# project key -> what verl's null means, in this project's spelling (_UNSET: the key sets nothing).
_UNSET = object()
NULL_MEANS: dict[str, Any] = {
    "trainer.max_ckpt_to_keep": 0,  # keep all
    "data.val_batch_size": 0,  # the whole validation set in one batch
    "rollout.log_prob_micro_batch_size_per_gpu": 0,  # the actor's micro-batch
    "ref.log_prob_micro_batch_size_per_gpu": 0,
    "trainer.rollout_data_dir": "",  # not written
    "actor.ppo_micro_batch_size_per_gpu": _UNSET,  # verl: only with use_dynamic_bsz; a memory setting
    "critic.ppo_micro_batch_size_per_gpu": _UNSET,
}


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every non-mapping value in a nested mapping; an empty or
    null section is dropped (it sets nothing), except a null `algorithm.rollout_correction`,
    which in verl switches the correction off."""
    if not isinstance(tree, dict):
        return [(prefix, tree)]
    out: list[tuple[str, Any]] = []
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) or (v is None and key in _OUR_SECTIONS and key != _RC):
            out += _leaves(v or {}, key)
        else:
            out.append((key, v))
    return out


_OUR_KEYS = frozenset(all_keys())
_OUR_SECTIONS = frozenset(_sections(PPOConfig, ""))


def translate_key(key: str, value: Any) -> tuple[str, Any] | None:
    """This project's (key, value) for one dotted verl or project key; None when the key is
    accepted but sets nothing (`FIXED` at its built-in value). Raises `ConfigError` for a
    verl key with no counterpart, naming it and the reason. Unknown keys pass through, for
    the config's own unknown-key check to report with the closest name."""
    if key == _RC and value is None:  # verl: no rollout_correction section, no correction
        return f"{_RC}.preset", "disabled"
    if key in _OUR_KEYS or key in VERL_KEYS:
        target = VERL_KEYS.get(key, key)
        if value is None and target in NULL_MEANS:
            meant = NULL_MEANS[target]
            return None if meant is _UNSET else (target, meant)
        return target, value
    if key in REFUSED:
        if value is None:
            return None  # verl's null: the key sets nothing there either
        raise ConfigError(f"verl key '{key}' has no counterpart here: {REFUSED[key]}")
    if key in FIXED:
        accepted, reason = FIXED[key]
        if any(a is _ANY or (value == a and isinstance(value, bool) == isinstance(a, bool)) for a in accepted):
            return None
        raise ConfigError(f"verl key '{key}={value}' is not supported: {reason}; remove the key")
    if key.startswith(_SECTIONS_ONLY_IN_VERL):
        raise ConfigError(f"verl key '{key}' has no counterpart here; remove it (docs/VERL.md lists the verl keys "
                          "that map onto this project's config)")
    return key, value


def translate_override(key: str, value: Any) -> list[tuple[str, Any]]:
    """The project's (key, value) pairs for one `key=value` override (a mapping value sets
    every leaf under `key`)."""
    out = []
    for k, v in _leaves({key: value}) if isinstance(value, dict) else [(key, value)]:
        kv = translate_key(k, v)
        if kv is not None:
            out.append(kv)
    return out


def translate_tree(tree: dict) -> dict:
    """A nested config mapping with verl's keys replaced by this project's (`translate_keys`
    without the flag); the defaults are the caller's (`rlhf.config.verl_defaults`)."""
    return translate_keys(tree)[0] if isinstance(tree, dict) else tree


def translate_keys(tree: dict) -> tuple[dict, bool]:
    """(`tree` with verl's keys replaced by this project's, whether it held a verl key name);
    the defaults are left to the caller."""
    leaves = _leaves(tree)
    if not _has_verl_leaf(leaves):
        return tree, False  # nothing to translate: keep the tree (and its own error messages) as it is
    out: dict = {}
    origin: dict[str, str] = {}
    for key, value in leaves:
        kv = translate_key(key, value)
        if kv is None:
            continue
        target, v = kv
        if target in origin and get_dotted(out, target) != v:
            raise ConfigError(f"config keys '{origin[target]}' and '{key}' both set '{target}' "
                              f"({get_dotted(out, target)!r} vs {v!r}); keep one")
        origin[target] = key
        _put(out, target, v)
    return out, True


def leaf_keys(tree: dict) -> set[str]:
    """The dotted keys of every value in a nested mapping."""
    return {k for k, _ in _leaves(tree)}


def is_verl_key(key: str, value: Any = None) -> bool:
    """Whether the dotted override `key` (with a mapping `value`, any leaf under it) is one of verl's own names."""
    return _has_verl_leaf(_leaves({key: value}) if isinstance(value, dict) else [(key, value)])


def _has_verl_leaf(leaves: list[tuple[str, Any]]) -> bool:
    return any(k not in _OUR_KEYS and (k in VERL_KEYS or k in REFUSED or k in FIXED or (k == _RC and v is None) or
                                       k.startswith(_SECTIONS_ONLY_IN_VERL)) for k, v in leaves)


def _put(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{p}' is not a section")
        node = child
    node[parts[-1]] = value
