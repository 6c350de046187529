"""verl's own config keys, with their full names, mapped onto `PPOConfig`.

A verl user's command line (`actor_rollout_ref.actor.ppo_mini_batch_size=64`,
`critic.optim.lr=1e-5`, `trainer.total_epochs=15`, ...) or a YAML file written in verl's
nesting (`actor_rollout_ref: {actor: {optim: {lr: ...}}}`) is translated here, before the
key check, by `translate_tree` (a nested mapping) and `translate_override` (one dotted
key). Keys that are already this project's keep their meaning; verl keys with a
counterpart are renamed (`VERL_KEYS`); verl keys without one raise `ConfigError` with the
reason (`REFUSED`, or a generic reason for anything else under a verl-only section);
keys whose only accepted value is the behaviour built in here (`FIXED`) pass with that
value and raise with any other. docs/VERL.md lists the same table for people.
"""

from __future__ import annotations

from typing import Any

from rlhf.config.schema import ConfigError, PPOConfig, _sections, all_keys

_AR = "actor_rollout_ref"

# verl key -> this project's key.
VERL_KEYS: dict[str, str] = {
    f"{_AR}.model.path": "model.path",
    f"{_AR}.model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
    f"{_AR}.model.trust_remote_code": "model.trust_remote_code",
    f"{_AR}.model.use_remove_padding": "data.use_sequence_packing",
    f"{_AR}.actor.optim.lr": "actor.lr",
    f"{_AR}.actor.optim.weight_decay": "actor.weight_decay",
    **{f"{_AR}.actor.{k}": f"actor.{k}" for k in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff",
        "grad_clip", "loss_agg_mode", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "shuffle",
        "tis_imp_ratio_cap")},
    **{f"{_AR}.rollout.{k}": f"rollout.{k}" for k in (
        "name", "n", "temperature", "top_p", "top_k", "tensor_model_parallel_size", "gpu_memory_utilization",
        "max_num_batched_tokens", "log_prob_micro_batch_size_per_gpu", "free_cache_engine", "enforce_eager",
        "max_num_seqs")},
    f"{_AR}.rollout.val_kwargs.temperature": "rollout.val_temperature",
    f"{_AR}.ref.log_prob_micro_batch_size_per_gpu": "ref.log_prob_micro_batch_size_per_gpu",
    "critic.optim.lr": "critic.lr",
    "critic.optim.weight_decay": "critic.weight_decay",
    "critic.model.path": "model.critic_path",
    "reward_model.model.path": "reward.model_path",
    "reward_model.micro_batch_size_per_gpu": "reward.model_batch_size",
    "trainer.resume_mode": "trainer.resume",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
}

_SECTIONS_ONLY_IN_VERL = (f"{_AR}.", "reward_model.", "custom_reward_function.", "ray_init.", "ray_kwargs.",
                          "global_profiler.", "critic.model.", "critic.optim.")

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
    f"{_AR}.actor.optim.lr_warmup_steps_ratio": "the PPO learning rate is constant here",
    "critic.optim.lr_warmup_steps_ratio": "the PPO learning rate is constant here",
    f"{_AR}.actor.optim.warmup_style": "the PPO learning rate is constant here",
    "critic.optim.warmup_style": "the PPO learning rate is constant here",
    f"{_AR}.rollout.mode": "rollout runs in the trainer's process (hf, hf_fast) or a colocated vLLM engine; "
                           "choose rollout.name",
    f"{_AR}.rollout.response_length": "set data.max_response_length",
    f"{_AR}.rollout.prompt_length": "set data.max_prompt_length",
    "data.custom_cls.path": "datasets are parquet files in verl's layout; no custom dataset class is loaded",
    "data.tokenizer": "the tokenizer is the one saved beside the policy (model.path)",
}

# verl key -> (the only value accepted, the reason).
FIXED: dict[str, tuple[Any, str]] = {
    "data.prompt_key": ("prompt", "the prompt column is always 'prompt' (verl's default)"),
    "data.reward_fn_key": ("data_source", "the reward function is chosen by 'data_source' (verl's default)"),
    f"{_AR}.hybrid_engine": (True, "rollout and update always share the process and the GPUs here"),
    "reward_model.enable": (None, ""),  # either value: a reward model is used where rows ask for one
}


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every non-mapping value in a nested mapping; an empty or
    null section is dropped (it sets nothing)."""
    if not isinstance(tree, dict):
        return [(prefix, tree)]
    out: list[tuple[str, Any]] = []
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) or (v is None and key in _OUR_SECTIONS):
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
    if key in _OUR_KEYS:
        return key, value
    if key in VERL_KEYS:
        return VERL_KEYS[key], value
    if key in REFUSED:
        raise ConfigError(f"verl key '{key}' has no counterpart here: {REFUSED[key]}")
    if key in FIXED:
        fixed, reason = FIXED[key]
        if fixed is None or value == fixed:
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
    """A nested config mapping with verl's keys replaced by this project's. Two keys that land
    on the same project key with different values raise `ConfigError` naming both."""
    if not isinstance(tree, dict):
        return tree
    leaves = _leaves(tree)
    if not _has_verl_leaf(leaves):
        return tree  # nothing to translate: keep the tree (and its own error messages) as it is
    out: dict = {}
    origin: dict[str, str] = {}
    for key, value in leaves:
        kv = translate_key(key, value)
        if kv is None:
            continue
        target, v = kv
        if target in origin and _get(out, target) != v:
            raise ConfigError(f"config keys '{origin[target]}' and '{key}' both set '{target}' "
                              f"({_get(out, target)!r} vs {v!r}); keep one")
        origin[target] = key
        _put(out, target, v)
    return out


def _has_verl_leaf(leaves: list[tuple[str, Any]]) -> bool:
    return any(k not in _OUR_KEYS and (k in VERL_KEYS or k in REFUSED or k in FIXED or
                                       k.startswith(_SECTIONS_ONLY_IN_VERL)) for k, _ in leaves)


def _get(tree: dict, key: str) -> Any:
    node: Any = tree
    for p in key.split("."):
        node = node[p]
    return node


def _put(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{p}' is not a section")
        node = child
    node[parts[-1]] = value
