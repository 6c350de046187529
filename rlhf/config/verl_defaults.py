"""verl 0.9.1's defaults, in force when a launch speaks verl.

A launch that uses one of verl's own key names (`actor_rollout_ref.*`, `critic.optim.*`,
`critic.model.*`, ...: anything `rlhf.config.verl_keys` translates, fixes or refuses), or
says `defaults=verl`, is a verl run: every key it leaves unset takes the value verl 0.9.1's
`ppo_trainer.yaml` gives it (`VERL_DEFAULTS`, each with the verl key it is the default of;
`VERL_FOLLOWS` where verl's yaml interpolates one key from another). A launch in this
project's own names keeps this project's defaults; `defaults=project` keeps them in either
case. The choice is made once, where the config is read (`resolve_defaults`, applied under
the launch's explicit keys), and recorded in the config's `defaults` key, so a saved config
reloads as the same run. `defaults_line` is the line a launch prints about it.
tests/test_verl_defaults.py holds every entry to verl's generated config.
"""

from __future__ import annotations

import logging
from typing import Any

from rlhf.config.schema import ConfigError, PPOConfig, flatten, get_dotted

log = logging.getLogger(__name__)

VERL, PROJECT = "verl", "project"
_AR = "actor_rollout_ref"

# project key -> (verl 0.9.1's default, the verl key it is the default of).
VERL_DEFAULTS: dict[str, tuple[Any, str]] = {
    "data.train_batch_size": (1024, "data.train_batch_size"),
    "data.max_prompt_length": (512, "data.max_prompt_length"),
    "data.max_response_length": (512, "data.max_response_length"),
    "data.filter_overlong_prompts": (False, "data.filter_overlong_prompts"),
    "data.truncation": ("error", "data.truncation"),
    "data.shuffle": (True, "data.shuffle"),
    "data.val_batch_size": (0, "data.val_batch_size"),  # verl's null: the whole validation set at once
    "data.use_sequence_packing": (True, f"{_AR}.model.use_remove_padding"),
    "model.enable_gradient_checkpointing": (True, f"{_AR}.model.enable_gradient_checkpointing"),
    "model.trust_remote_code": (False, f"{_AR}.model.trust_remote_code"),
    "critic.enable_gradient_checkpointing": (True, "critic.model.enable_gradient_checkpointing"),
    "actor.lr": (1e-6, f"{_AR}.actor.optim.lr"),
    "actor.weight_decay": (0.01, f"{_AR}.actor.optim.weight_decay"),
    "actor.grad_clip": (1.0, f"{_AR}.actor.optim.clip_grad"),
    "actor.ppo_mini_batch_size": (256, f"{_AR}.actor.ppo_mini_batch_size"),
    "actor.use_dynamic_bsz": (False, f"{_AR}.actor.use_dynamic_bsz"),
    "actor.ppo_max_token_len_per_gpu": (16384, f"{_AR}.actor.ppo_max_token_len_per_gpu"),
    "actor.ppo_epochs": (1, f"{_AR}.actor.ppo_epochs"),
    "actor.shuffle": (False, f"{_AR}.actor.shuffle"),
    "actor.clip_ratio": (0.2, f"{_AR}.actor.clip_ratio"),
    "actor.clip_ratio_low": (0.2, f"{_AR}.actor.clip_ratio_low"),
    "actor.clip_ratio_high": (0.2, f"{_AR}.actor.clip_ratio_high"),
    "actor.clip_ratio_c": (3.0, f"{_AR}.actor.clip_ratio_c"),
    "actor.loss_agg_mode": ("token-mean", f"{_AR}.actor.loss_agg_mode"),
    "actor.entropy_coeff": (0.0, f"{_AR}.actor.entropy_coeff"),
    "actor.use_kl_loss": (False, f"{_AR}.actor.use_kl_loss"),
    "actor.kl_loss_coef": (0.001, f"{_AR}.actor.kl_loss_coef"),
    "actor.kl_loss_type": ("low_var_kl", f"{_AR}.actor.kl_loss_type"),
    "rollout.n": (1, f"{_AR}.rollout.n"),
    "rollout.temperature": (1.0, f"{_AR}.rollout.temperature"),
    "rollout.top_p": (1.0, f"{_AR}.rollout.top_p"),
    "rollout.top_k": (-1, f"{_AR}.rollout.top_k"),
    "rollout.val_temperature": (0.0, f"{_AR}.rollout.val_kwargs.temperature"),
    "rollout.gpu_memory_utilization": (0.5, f"{_AR}.rollout.gpu_memory_utilization"),
    "rollout.max_num_batched_tokens": (8192, f"{_AR}.rollout.max_num_batched_tokens"),
    "critic.lr": (1e-5, "critic.optim.lr"),
    "critic.weight_decay": (0.01, "critic.optim.weight_decay"),
    "critic.grad_clip": (1.0, "critic.optim.clip_grad"),
    "critic.cliprange_value": (0.5, "critic.cliprange_value"),
    "algorithm.adv_estimator": ("gae", "algorithm.adv_estimator"),
    "algorithm.gamma": (1.0, "algorithm.gamma"),
    "algorithm.lam": (1.0, "algorithm.lam"),
    "algorithm.norm_adv_by_std_in_grpo": (True, "algorithm.norm_adv_by_std_in_grpo"),
    "algorithm.use_kl_in_reward": (False, "algorithm.use_kl_in_reward"),
    "algorithm.kl_penalty": ("kl", "algorithm.kl_penalty"),
    "algorithm.kl_ctrl.type": ("fixed", "algorithm.kl_ctrl.type"),
    "algorithm.kl_ctrl.kl_coef": (0.001, "algorithm.kl_ctrl.kl_coef"),
    "algorithm.kl_ctrl.target_kl": (0.1, "algorithm.kl_ctrl.target_kl"),
    "algorithm.kl_ctrl.horizon": (10000, "algorithm.kl_ctrl.horizon"),
    "algorithm.rollout_correction.rollout_is": (None, "algorithm.rollout_correction.rollout_is"),
    "algorithm.rollout_correction.rollout_is_threshold": (2.0, "algorithm.rollout_correction.rollout_is_threshold"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": (
        False, "algorithm.rollout_correction.rollout_is_batch_normalize"),
    "algorithm.rollout_correction.rollout_rs": (None, "algorithm.rollout_correction.rollout_rs"),
    "algorithm.rollout_correction.rollout_rs_threshold": (None, "algorithm.rollout_correction.rollout_rs_threshold"),
    "algorithm.rollout_correction.bypass_mode": (False, "algorithm.rollout_correction.bypass_mode"),
    "trainer.total_epochs": (30, "trainer.total_epochs"),
    "trainer.save_freq": (-1, "trainer.save_freq"),
    "trainer.test_freq": (-1, "trainer.test_freq"),
    "trainer.val_before_train": (True, "trainer.val_before_train"),
    "trainer.critic_warmup": (0, "trainer.critic_warmup"),
    "trainer.balance_batch": (True, "trainer.balance_batch"),
    "trainer.resume": ("auto", "trainer.resume_mode"),
    "trainer.max_ckpt_to_keep": (0, "trainer.max_actor_ckpt_to_keep"),  # verl's null: keep all
    "trainer.rollout_data_dir": ("", "trainer.rollout_data_dir"),  # verl's null: not written
}

# key prefix -> explicit keys that set it another way: then verl's defaults under the prefix are not filled in.
SET_OTHERWISE: dict[str, tuple[str, ...]] = {
    "trainer.total_epochs": ("trainer.total_rounds",),  # the launch counts rounds
    # a preset or the older TIS cap sets the whole correction (`correction_settings`)
    "algorithm.rollout_correction.": ("algorithm.rollout_correction.preset", "actor.tis_imp_ratio_cap"),
}

# project key -> the project key whose value it takes when unset (verl's `${oc.select:...}`).
VERL_FOLLOWS: dict[str, str] = {
    "critic.ppo_epochs": "actor.ppo_epochs",  # critic.ppo_epochs: ${...actor.ppo_epochs}
    "critic.loss_agg_mode": "actor.loss_agg_mode",  # critic.loss_agg_mode: ${...actor.loss_agg_mode}
}

# this project's keys with no verl counterpart, set to what verl does.
VERL_BEHAVIOUR: dict[str, tuple[Any, str]] = {
    "early_stop.enable": (False, "verl has no early stopping: a run goes to its last step"),
}

# keys whose verl meaning is none (verl 0.9.1 reads another key): refused in a launch written in verl's names.
NOT_READ_BY_VERL: dict[str, str] = {
    "critic.grad_clip": "verl 0.9.1 does not read critic.grad_clip (the critic's clip norm is "
                        "critic.optim.clip_grad); set critic.optim.clip_grad",
}


def choose(tree: dict, verl_keys_used: bool) -> str:
    """`tree`'s explicit `defaults`, else verl's when the launch used a verl key name."""
    return tree.get("defaults") or (VERL if verl_keys_used else PROJECT)


def resolve_defaults(tree: dict, verl_keys_used: bool, given: set[str] = frozenset()) -> dict:
    """`tree` (nested, this project's keys) with `defaults` recorded and, for a verl run, every
    unset key of `VERL_DEFAULTS`, `VERL_FOLLOWS` and `VERL_BEHAVIOUR` filled in (explicit keys
    win). `given`: the key names as the launch wrote them, for `NOT_READ_BY_VERL` (checked when
    verl's names, not an explicit `defaults`, chose verl's defaults)."""
    choice = choose(tree, verl_keys_used)
    out = {**tree, "defaults": choice}
    if choice != VERL:
        return out
    for key, reason in NOT_READ_BY_VERL.items():
        if key in given and not tree.get("defaults"):  # verl's names chose verl: a saved config keeps its keys
            raise ConfigError(f"config key '{key}' is not used under verl's defaults: {reason} "
                              "(or set defaults=project)")
    skip = tuple(prefix for prefix, others in SET_OTHERWISE.items() if any(_has(out, k) for k in others))
    for key, (value, _) in {**VERL_DEFAULTS, **VERL_BEHAVIOUR}.items():
        if not _has(out, key) and not any(key.startswith(prefix) for prefix in skip):
            out = _with(out, key, value)
    for key, source in VERL_FOLLOWS.items():
        if not _has(out, key):
            out = _with(out, key, get_dotted(out, source))
    _warn_unused_clip_ratio(out, given)
    return out


def _warn_unused_clip_ratio(tree: dict, given: set[str]) -> None:
    """verl's clip_ratio_low and clip_ratio_high default to 0.2 and win over clip_ratio
    (`core_algos.compute_policy_loss_vanilla`), so in a verl run clip_ratio alone changes nothing."""
    if not given & {"actor.clip_ratio", f"{_AR}.actor.clip_ratio"}:
        return
    if not given & {"actor.clip_ratio_low", f"{_AR}.actor.clip_ratio_low"} or \
            not given & {"actor.clip_ratio_high", f"{_AR}.actor.clip_ratio_high"}:
        log.warning("actor.clip_ratio=%s is not the PPO clip under verl's defaults: clip_ratio_low and "
                    "clip_ratio_high default to 0.2 and take precedence, as in verl 0.9.1; set them to change "
                    "the clip", get_dotted(tree, "actor.clip_ratio"))


def defaults_line(cfg: PPOConfig) -> str:
    """One line: whose defaults are in force, and for verl's the values that differ from this project's."""
    if cfg.defaults != VERL:
        return ("defaults: this project's (docs/CONFIG.md); a launch in verl's key names, or defaults=verl, "
                "takes verl 0.9.1's")
    project, flat = flatten(PPOConfig()), flatten(cfg)
    shown = [f"{k}={_show(flat[k])}" for k, (v, _) in {**VERL_DEFAULTS, **VERL_BEHAVIOUR}.items()
             if flat[k] == v and project[k] != v]
    shown += [f"{k}={_show(flat[k])}" for k, src in VERL_FOLLOWS.items()
              if flat[k] == flat[src] and project[k] != flat[k]]
    return (f"defaults: verl 0.9.1's (the launch uses verl's key names; defaults=project keeps this project's); "
            f"in force where they differ from this project's: {' '.join(shown)}")


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _has(tree: dict, key: str) -> bool:
    node: Any = tree
    for p in key.split("."):
        if not isinstance(node, dict) or p not in node:
            return False
        node = node[p]
    return True


def _with(tree: dict, key: str, value: Any) -> dict:
    """A copy of `tree` with `key` set (sections copied on the way down, never mutated)."""
    head, _, rest = key.partition(".")
    if not rest:
        return {**tree, head: value}
    section = tree.get(head)
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(f"config key '{key}': '{head}' is not a section")
    return {**tree, head: _with(section, rest, value)}
