"""The one configuration tree: `PPOConfig`.

Field names follow verl's dotted keys (`actor.clip_ratio`, `algorithm.kl_ctrl.kl_coef`,
...) so a verl config carries over. The tree is frozen: it is parsed once, from a
YAML/JSON file plus dotted `key=value` overrides, and never mutated afterwards.
Unknown keys raise with the closest valid name. `derive_sizes` is the one function
that turns batch settings into per-GPU sizes and checks that they divide.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import functools
import json
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional, get_args, get_origin, get_type_hints

import yaml


# libyaml's loader and dumper when PyYAML has them (6x faster), with the same safe types.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key and what to do."""


# ---------------------------------------------------------------------------------
# The tree
# ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticDataConfig:
    """The embedded arithmetic task used when no dataset files are given."""

    n_sft: int = 1500  # labeled problems the SFT warm-start sees: enough that it generalizes rather than memorizes (user data: at most this many labeled train rows)
    n_train: int = 20000  # unlabeled prompts PPO draws from (ground truth only for the verifier)
    n_val: int = 500  # held-out problems for greedy validation
    digits: int = 2  # digits per operand
    operators: str = "+"  # operators drawn from, e.g. "+-*"
    n_steps: int = 1  # binary operations per problem (2 => "a+b+c")
    seed: int = 1234  # seed of the generated problems


@dataclass(frozen=True)
class DataConfig:
    train_files: str = ""  # parquet file/dir/URI (verl layout); "" => synthetic arithmetic
    val_files: str = ""  # validation parquet (same layout); required with train_files
    rollout_files: str = ""  # stored rollout table(s) (parquet file/dir/URI) read in place of generation: offline RLHF
    prompt_format: str = "text"  # "text" | "chat" (chat lists rendered with the template)
    train_batch_size: int = 64  # prompts per PPO step
    val_batch_size: int = 0  # prompts per validation generate call; 0 => the whole val set in one call
    max_prompt_length: int = 32  # prompt tokens; longer prompts are filtered, truncated or refused
    max_response_length: int = 16  # new tokens per response
    filter_overlong_prompts: bool = True  # drop prompts longer than max_prompt_length before sampling
    truncation: str = "error"  # "error" | "left" | "right"
    shuffle: bool = True  # seeded global shuffle per epoch
    drop_invalid: bool = False  # drop (and count) invalid rows instead of raising
    use_sequence_packing: bool = False  # pack sequences into rows without padding in the update
    base_dir: str = ""  # if set, dataset paths may not escape it
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


@dataclass(frozen=True)
class TinyModelConfig:
    """The default policy: a small Llama built in code with a character tokenizer."""

    hidden_size: int = 128  # ~0.87M parameters with the 100-token char vocab
    num_hidden_layers: int = 4  # decoder layers
    num_attention_heads: int = 4  # attention heads (head size >= 32 for vLLM's CPU kernels)
    num_key_value_heads: int = 4  # key/value heads (GQA when fewer than attention heads)
    intermediate_size: int = 384  # MLP width
    max_position_embeddings: int = 128  # longest sequence
    tie_word_embeddings: bool = True  # share the input embedding with the output head


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-start on the labeled set (loss on answer tokens only)."""

    enable: bool = True  # run the warm-start (off: PPO starts from the random tiny model)
    max_seconds: float = 3600.0  # wall-clock safety cap only: a time cap would make the result depend on machine load
    epochs: int = 1000  # passes over the labeled set (a cap)
    max_steps: int = 4000  # optimizer steps (a cap: the slowest measured phase change came at 1,600); 0 => epochs
    batch_size: int = 64  # examples per SFT step
    lr: float = 3e-3  # AdamW learning rate
    lr_schedule: str = "constant"  # "constant" | "cosine" (to min_lr_ratio * lr), after warmup
    min_lr_ratio: float = 0.1  # cosine schedule floor as a fraction of lr
    warmup_steps: int = 20  # linear warmup steps
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max gradient norm
    log_every: int = 50  # print a progress line every this many steps
    num_threads: int = 1  # torch CPU threads during SFT (results depend on it); 0 => torch's default
    stop_at_accuracy: float = 0.4  # > 0: stop once greedy accuracy on the probe (training problems) reaches this
    probe_size: int = 256  # training problems the accuracy probe decodes
    probe_every: int = 25  # steps between probes (accuracy climbs fast past the phase change)


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # local HF causal-LM dir or URI; "" => tiny model built in code
    critic_path: str = ""  # "" => critic backbone initialised from the actor
    trust_remote_code: bool = False  # allow model code from the checkpoint directory
    allow_network: bool = False  # hub names are fetched only when this is true
    dtype: str = "float32"  # "float32" | "bfloat16"
    enable_gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


@dataclass(frozen=True)
class ActorConfig:
    lr: float = 2e-4  # actor learning rate (AdamW)
    weight_decay: float = 0.0  # actor AdamW weight decay
    ppo_epochs: int = 2  # passes over each step's batch
    ppo_mini_batch_size: int = 16  # in prompts (times rollout.n responses), verl semantics
    ppo_micro_batch_size_per_gpu: int = 64  # in responses
    use_dynamic_bsz: bool = False  # micro-batches by token budget instead of a fixed row count
    ppo_max_token_len_per_gpu: int = 16384  # token budget per micro-batch with use_dynamic_bsz
    clip_ratio: float = 0.2  # PPO ratio clip epsilon
    clip_ratio_low: Optional[float] = None  # None => clip_ratio
    clip_ratio_high: Optional[float] = None  # None => clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages
    entropy_coeff: float = 0.0  # entropy bonus weight
    grad_clip: float = 1.0  # max gradient norm
    loss_agg_mode: str = "token-mean"  # token-mean / seq-mean-token-sum / seq-mean-token-mean / seq-mean-token-sum-norm
    use_kl_loss: bool = False  # KL to the reference as a loss term (GRPO style)
    kl_loss_coef: float = 0.001  # weight of the KL loss term
    kl_loss_type: str = "low_var_kl"  # KL estimator for the loss term
    shuffle: bool = False  # reshuffle each step's rows into new mini-batches every PPO epoch (verl's actor.shuffle)
    tis_imp_ratio_cap: float = -1.0  # > 0: token-level truncated IS at this cap (verl's older TIS key); -1 => off


@dataclass(frozen=True)
class CriticConfig:
    lr: float = 1e-3  # critic learning rate (AdamW)
    weight_decay: float = 0.0  # critic AdamW weight decay
    ppo_epochs: int = 2  # passes over each step's batch
    cliprange_value: float = 0.5  # value clipping range around the old values
    grad_clip: float = 1.0  # max gradient norm
    loss_agg_mode: str = "token-mean"  # aggregation of the value loss
    ppo_micro_batch_size_per_gpu: int = 64  # responses per critic forward/backward


@dataclass(frozen=True)
class RolloutConfig:
    name: str = "hf"  # "hf" | "hf_fast" (static cache, CUDA graphs, Triton kernels on GPU) | "vllm"
    n: int = 4  # responses per prompt
    temperature: float = 1.5  # sampling temperature (log-probs use the same); above 1 explores past a confident SFT start
    top_p: float = 1.0  # nucleus sampling
    top_k: int = -1  # -1 => off
    tensor_model_parallel_size: int = 1  # vLLM tensor parallel size
    gpu_memory_utilization: float = 0.5  # vLLM share of GPU memory
    max_num_batched_tokens: int = 8192  # vLLM scheduler token budget
    generate_batch_size: int = 256  # sequences per HF generate call
    log_prob_micro_batch_size_per_gpu: int = 0  # responses per forward when recomputing behaviour log-probs; 0 => actor.ppo_micro_batch_size_per_gpu
    val_temperature: float = 0.0  # validation sampling temperature; 0 => greedy


@dataclass(frozen=True)
class RefConfig:
    """The frozen reference policy (the starting policy, KL anchor)."""

    log_prob_micro_batch_size_per_gpu: int = 0  # responses per reference forward; 0 => actor.ppo_micro_batch_size_per_gpu


@dataclass(frozen=True)
class KLCtrlConfig:
    type: str = "fixed"  # "fixed" | "adaptive"
    kl_coef: float = 0.001  # KL coefficient (initial value for adaptive)
    target_kl: float = 1.0  # adaptive target; also the early-stop KL budget (mean per-token KL to the reference)
    horizon: int = 10000  # adaptive controller horizon


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance weights and rejection for samples whose log-probs (rollout engine, stored
    table) differ from the trainer's (`rlhf.algos.correction`; verl's names). On by default
    as token-level truncated IS at 2.0 (verl's `decoupled_token_is`, TRL's default-on vLLM
    correction): when the engines agree the weights are 1 and nothing changes; when they
    do not (bf16 or vLLM kernels, stale or offline data) the bias is corrected."""

    preset: str = ""  # a named setting (verl's presets), e.g. decoupled_seq_is_rs; "" => the fields below
    rollout_is: Optional[str] = "token"  # IS weights: "token" | "sequence" | null (off)
    rollout_is_threshold: float = 2.0  # upper cap of the IS weights (truncated IS)
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean
    rollout_rs: Optional[str] = None  # rejection: "token" | "sequence" | "geometric" | null (off)
    rollout_rs_threshold: Optional[float] = None  # rejection upper bound; null => rollout_is_threshold
    rollout_rs_threshold_lower: Optional[float] = None  # rejection lower bound; null => 1 / upper
    rollout_token_veto_threshold: Optional[float] = None  # drop a response with any token ratio below this
    bypass_mode: bool = False  # PPO ratio anchored at the rollout log-probs (no trainer recompute, no IS)


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = "gae"  # "gae" | "grpo" | "rloo" | "reinforce_plus_plus_baseline"
    gamma: float = 1.0  # discount
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # divide GRPO advantages by the group std
    use_kl_in_reward: bool = True  # subtract kl_coef * KL from the token rewards
    kl_penalty: str = "kl"  # "kl"/"k1" | "abs" | "mse"/"k2" | "low_var_kl"/"k3"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass(frozen=True)
class RewardConfig:
    gsm8k_method: str = "strict"  # "strict" | "flexible"
    format_score: float = 0.0  # score for a well-formed wrong answer
    score: float = 1.0  # score for a correct answer
    model_path: str = ""  # reward model dir for rows with reward_style == "model"
    model_batch_size: int = 32  # reward-model batch size


@dataclass(frozen=True)
class TrainerConfig:
    total_rounds: int = 100  # rounds to run (fewer on early stop)
    total_epochs: int = 0  # > 0: passes over the train set; sets total_rounds once the train set's size is known
    steps_per_round: int = 1  # PPO steps per rollout buffer (1 => on-policy)
    test_freq: int = 1  # evaluate every k rounds; -1 => never (no validation, as verl)
    critic_warmup: int = 0  # the first this many PPO steps update only the critic (verl's critic_warmup)
    rollout_data_dir: str = ""  # if set, each round's scored rollouts go here as parquet (offline RLHF input)
    val_before_train: bool = True  # evaluate the starting policy
    logger: list[str] = field(default_factory=lambda: ["console"])  # sinks: console, mlflow, wandb, none
    project_name: str = "rlhf-ppo"  # MLflow experiment
    experiment_name: str = "default"  # MLflow run name
    mlflow_tracking_uri: str = ""  # "" => $MLFLOW_TRACKING_URI or a local SQLite store
    output_dir: str = "outputs"  # checkpoints, summary and local stores
    resume: str = "auto"  # "auto" (latest checkpoint in output_dir) | "disable" | a checkpoint dir or URI to start from
    seed: int = 0  # seed of sampling, init and SFT
    n_gpus_per_node: int = 1  # ranks per node (torchrun nproc_per_node)
    nnodes: int = 1  # nodes
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    num_threads: int = 1  # torch CPU threads per process on CPU (tiny models run fastest on one); 0 => default
    profile_steps: list[int] = field(default_factory=list)  # global steps to trace with torch.profiler
    balance_batch: bool = True  # split each PPO mini-batch over ranks by equal rows and near-equal tokens
    max_ckpt_to_keep: int = 2  # checkpoints kept (the newest save points); <= 0 => all
    save_freq: int = 5  # rounds between checkpoints (plus one after the last round); -1 => only at the end
    granularity: str = "segment"  # Flyte rounds: "segment" (K rounds per GPU task; real sizes) | "stage" (task per stage)
    rounds_per_segment: int = 10  # K: rounds one colocated Flyte segment runs (granularity=segment)


@dataclass(frozen=True)
class DeepSpeedConfig:
    zero_stage: int = 0  # ZeRO stage 0-3 for actor and critic
    bf16: bool = False  # bf16 weights and compute
    offload: bool = False  # optimizer (and ZeRO-3 params) offload to CPU


@dataclass(frozen=True)
class EarlyStopConfig:
    enable: bool = True  # apply the early-stop rules
    kl_patience: int = 3  # stop after KL > target_kl for this many consecutive steps
    kl_ceiling: float = 2.0  # stop at once when KL exceeds this
    val_patience: int = 0  # stop after this many evaluations without improvement; 0 => off
    min_delta: float = 0.0  # val improvement that counts
    max_nonfinite_steps: int = 3  # stop after this many skipped (non-finite) steps


@dataclass(frozen=True)
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)

    @classmethod
    def from_json(cls, text: str) -> "PPOConfig":
        """The config `pyflyte run ... --cfg FILE|JSON` builds (flytekit's click type for a
        dataclass input calls `from_json` with the parsed file). Unknown keys raise
        `ConfigError`; the values convert exactly as flytekit's own dataclass decoding
        (dataclasses_json, which keeps unknown keys out silently) converts them."""
        from rlhf.config.keys import from_json_checked

        return from_json_checked(cls, text)

    @classmethod
    def __pre_deserialize__(cls, d: dict) -> dict:
        """mashumaro's hook, run when flytekit decodes a config input in a task: the same key
        check, for a config launched from outside Python (console, flytectl)."""
        from rlhf.config.keys import check_keys
        from rlhf.config.verl_keys import translate_tree

        d = translate_tree(d)
        check_keys(d, "cfg input")
        return d


_CHOICES: dict[str, tuple[str, ...]] = {
    "data.prompt_format": ("text", "chat"),
    "data.truncation": ("error", "left", "right"),
    "model.dtype": ("float32", "bfloat16"),
    "model.sft.lr_schedule": ("constant", "cosine"),
    "rollout.name": ("hf", "hf_fast", "vllm"),
    "algorithm.adv_estimator": ("gae", "grpo", "rloo", "reinforce_plus_plus_baseline"),
    "algorithm.rollout_correction.rollout_is": (None, "token", "sequence"),
    "algorithm.rollout_correction.rollout_rs": (None, "token", "sequence", "geometric"),
    "algorithm.kl_penalty": ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"),
    "actor.kl_loss_type": ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "actor.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "critic.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "reward.gsm8k_method": ("strict", "flexible"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.granularity": ("segment", "stage"),
}
_LOGGERS = ("console", "mlflow", "wandb", "none")


# ---------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """`get_type_hints(cls)`, computed once per class (it dominates loading otherwise)."""
    return get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def _all_keys(cls: type, prefix: str) -> tuple[str, ...]:
    keys: list[str] = []
    hints = _hints(cls)
    for f in fields(cls):
        t = hints[f.name]
        if is_dataclass(t):
            keys += _all_keys(t, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return tuple(keys)


def all_keys(cls: type = PPOConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the tree, e.g. `algorithm.kl_ctrl.kl_coef`."""
    return list(_all_keys(cls, prefix))


@functools.lru_cache(maxsize=None)
def _sections(cls: type, prefix: str) -> tuple[str, ...]:
    hints = _hints(cls)
    out: list[str] = []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            out += [f"{prefix}{f.name}", *_sections(hints[f.name], f"{prefix}{f.name}.")]
    return tuple(out)


def _key_names(cls: type | None = None) -> list[str]:
    """Every dotted leaf key and section name of `cls` (default `PPOConfig`), the candidates
    an unknown key is matched to."""
    cls = cls or PPOConfig
    return [*_all_keys(cls, ""), *_sections(cls, "")]


def _hint(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}."


def _unknown(key: str, valid: list[str], where: str) -> ConfigError:
    return ConfigError(f"unknown config key '{key}'{where}{_hint(key, valid).rstrip('.')}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = get_origin(tp)
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if value else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        (item_tp,) = get_args(tp)
        return [_coerce(key, v, item_tp) for v in value]
    args = [a for a in get_args(tp) if a is not type(None)]
    if origin is not None and args:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return _coerce(key, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            try:
                number = float(number)
            except OverflowError:
                raise ConfigError(f"config key '{key}' is too large for a float: {value!r}") from None
            if math.isnan(number):
                raise ConfigError(f"config key '{key}' is NaN; give a number")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"config key '{key}' expects {getattr(tp, '__name__', tp)}, got {value!r}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            raise _unknown(f"{prefix}{k}", _key_names(), "")
        t = hints[k]
        if is_dataclass(t):
            kwargs[k] = _build(t, v if v is not None else {}, f"{prefix}{k}.")
        else:
            kwargs[k] = _coerce(f"{prefix}{k}", v, t)
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    keys = _all_keys(PPOConfig, "")
    if key not in keys and not any(k.startswith(key + ".") for k in keys):
        raise _unknown(key, list(keys), " in override")
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{key}': '{p}' is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", parsed value); the value is parsed as YAML (`1e-3`, `true`, `[a,b]`)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value, e.g. actor.clip_ratio=0.3")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_like_float(raw):
        value = float(raw)
    return key, value


def _looks_like_float(raw: str) -> bool:
    try:
        float(raw)
        return True
    except ValueError:
        return False


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def flatten(cfg: Any) -> dict[str, Any]:
    """`{"actor.clip_ratio": 0.2, ...}` for MLflow params."""
    out: dict[str, Any] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(to_dict(cfg), "")
    return out


MAX_CONFIG_VALUES = 10_000  # a config has ~150 keys; more values means repeated YAML aliases
MAX_CONFIG_DEPTH = 16  # sections nest 3 deep


def _plain(value: Any, key: str, seen: tuple[int, ...], count: list[int]) -> Any:
    """A copy made of dicts, lists and plain scalars; anything else (dates, sets, bytes, aliases
    that refer to themselves or expand without bound) raises `ConfigError` naming the key."""
    count[0] += 1
    if count[0] > MAX_CONFIG_VALUES or len(seen) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"config data at '{key}' is nested too deeply or repeats YAML aliases beyond "
                          f"{MAX_CONFIG_VALUES} values; write the values out")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (datetime.date, datetime.time)):  # YAML reads an unquoted 2024-01-01 as a date
        return value.isoformat()
    if not isinstance(value, (dict, list, tuple)):
        raise ConfigError(f"config key '{key}' holds a {type(value).__name__} ({str(value)[:40]}); "
                          "write it as a quoted string or a number")
    if id(value) in seen:
        raise ConfigError(f"config key '{key}' refers to itself (a recursive YAML alias)")
    inner = seen + (id(value),)
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{key}.{k}" if key else str(k), inner, count) for k, v in value.items()}
    return [_plain(v, key, inner, count) for v in value]


def from_dict(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> PPOConfig:
    """Build and validate a config from a nested mapping plus dotted overrides."""
    from rlhf.config.verl_keys import translate_override, translate_tree

    tree = translate_tree(_plain(data or {}, "", (), [0]))  # a deep copy of plain data, verl keys mapped
    for text in overrides:
        k, v = parse_override(text)
        for key, value in translate_override(k, _plain(v, k, (), [0])):
            _set_dotted(tree, key, value)
    cfg = _build(PPOConfig, tree)
    validate(cfg)
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> PPOConfig:
    """Load YAML or JSON (`path` may be None for the defaults) and apply overrides (a key
    given twice among them is warned about: the last one wins)."""
    from rlhf.config.ranges import warn_repeated

    warn_repeated(overrides)
    data: dict = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read config file '{path}': {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file '{path}' is not UTF-8 text ({e}); save it as UTF-8") from e
        try:
            data = json.loads(text) if str(path).endswith(".json") else yaml.load(text, Loader=_YAML_LOADER)
        except (yaml.YAMLError, json.JSONDecodeError) as e:
            raise ConfigError(f"config file '{path}' is not valid YAML/JSON: {e}") from e
        except RecursionError as e:
            raise ConfigError(f"config file '{path}' nests lists or mappings too deeply to parse") from e
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
    try:
        return from_dict(data, overrides)
    except ConfigError as e:
        if path:
            raise ConfigError(f"{path}: {e}") from e
        raise


def save_config(cfg: PPOConfig, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        yaml.dump(to_dict(cfg), f, Dumper=_YAML_DUMPER, sort_keys=False)


def replace(cfg: PPOConfig, overrides: list[str] | tuple[str, ...]) -> PPOConfig:
    """A new config: `cfg` with dotted overrides applied (the original is untouched)."""
    return from_dict(to_dict(cfg), overrides)


# ---------------------------------------------------------------------------------
# Validation and derived sizes
# ---------------------------------------------------------------------------------


def validate(cfg: PPOConfig) -> None:
    flat = flatten(cfg)
    _refuse_credentials(flat)
    for key, choices in _CHOICES.items():
        if flat[key] not in choices:
            raise ConfigError(f"config key '{key}' is {flat[key]!r}; choose one of "
                              f"{', '.join('null' if c is None else c for c in choices)}")
    for name in cfg.trainer.logger:
        if name not in _LOGGERS:
            raise ConfigError(f"trainer.logger entry {name!r} is unknown; choose from {', '.join(_LOGGERS)}")
    positive = [
        "data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
        "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size_per_gpu", "actor.ppo_epochs",
        "actor.ppo_max_token_len_per_gpu", "rollout.n", "trainer.total_rounds",
        "trainer.steps_per_round", "trainer.n_gpus_per_node", "trainer.nnodes",
        "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_epochs", "rollout.generate_batch_size",
        "trainer.rounds_per_segment",
    ]
    for key in positive:
        if flat[key] <= 0:
            raise ConfigError(f"config key '{key}' must be > 0, got {flat[key]}")
    if not cfg.trainer.resume.strip():
        raise ConfigError("trainer.resume is empty; give auto, disable, or the checkpoint directory to start from")
    if not 0 < cfg.actor.clip_ratio < 1:
        raise ConfigError(f"actor.clip_ratio must be in (0, 1), got {cfg.actor.clip_ratio}")
    if cfg.actor.clip_ratio_c <= 1:
        raise ConfigError(f"actor.clip_ratio_c must be > 1 (dual-clip bound), got {cfg.actor.clip_ratio_c}")
    if cfg.algorithm.kl_ctrl.kl_coef < 0:
        raise ConfigError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {cfg.algorithm.kl_ctrl.kl_coef}")
    if cfg.deepspeed.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {cfg.deepspeed.zero_stage}")
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        raise ConfigError("rollout.gpu_memory_utilization must be in (0, 1]")
    for key in ("trainer.total_epochs", "rollout.log_prob_micro_batch_size_per_gpu",
                "ref.log_prob_micro_batch_size_per_gpu"):
        if flat[key] < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {flat[key]}")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs rollout.n >= 2 "
                          "(a group per prompt)")
    if cfg.trainer.test_freq <= 0 and cfg.trainer.test_freq != -1:
        raise ConfigError(f"trainer.test_freq must be > 0, or -1 for no validation; got {cfg.trainer.test_freq}")
    if cfg.trainer.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup must be >= 0, got {cfg.trainer.critic_warmup}")
    if cfg.data.val_batch_size < 0 or cfg.rollout.val_temperature < 0:
        raise ConfigError("data.val_batch_size and rollout.val_temperature must be >= 0")
    correction_settings(cfg)  # raises on a bad preset or conflicting keys
    from rlhf.config.ranges import check_ranges

    check_ranges(flat)



GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")  # advantages from a prompt's group

# verl's rollout-correction presets (`RolloutCorrectionConfig.<name>()`), decoupled mode unless
# bypass; verl's pg_is / pg_rs (policy-gradient loss without clipping) are not offered here.
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "disabled": dict(rollout_is=None),  # mismatch metrics only
    "decoupled_token_is": dict(rollout_is="token", rollout_is_threshold=2.0),
    "decoupled_seq_is": dict(rollout_is="sequence", rollout_is_threshold=2.0),
    "decoupled_seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="sequence",
                                rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5),
    "decoupled_geo_rs": dict(rollout_is=None, rollout_rs="geometric", rollout_rs_threshold=1.001,
                             rollout_rs_threshold_lower=0.999, rollout_token_veto_threshold=1e-4),
    "ppo_is_bypass": dict(rollout_is=None, bypass_mode=True),
}


def correction_settings(cfg: PPOConfig) -> RolloutCorrectionConfig:
    """The rollout correction in effect: `algorithm.rollout_correction` with its `preset`
    applied, or token-level TIS at `actor.tis_imp_ratio_cap` when that is set. A preset
    or the cap together with changed fields raises (one source of truth per run)."""
    rc = cfg.algorithm.rollout_correction
    changed = {f.name for f in fields(rc) if f.name != "preset" and getattr(rc, f.name) != f.default}
    cap = cfg.actor.tis_imp_ratio_cap
    if cap != -1.0 and cap <= 0:
        raise ConfigError(f"actor.tis_imp_ratio_cap must be > 0, or -1 for off; got {cap}")
    if rc.preset:
        if rc.preset not in ROLLOUT_CORRECTION_PRESETS:
            raise ConfigError(f"algorithm.rollout_correction.preset {rc.preset!r} is unknown; choose one of "
                              f"{', '.join(ROLLOUT_CORRECTION_PRESETS)}")
        if changed or cap > 0:
            raise ConfigError(f"algorithm.rollout_correction.preset={rc.preset} sets the correction; remove "
                              f"{', '.join(sorted(changed)) or 'actor.tis_imp_ratio_cap'} or the preset")
        rc = dataclasses.replace(RolloutCorrectionConfig(), **ROLLOUT_CORRECTION_PRESETS[rc.preset])
    elif cap > 0:
        if changed:
            raise ConfigError(f"actor.tis_imp_ratio_cap is verl's older spelling of rollout_is=token with "
                              f"rollout_is_threshold=cap; remove it or algorithm.rollout_correction."
                              f"{', algorithm.rollout_correction.'.join(sorted(changed))}")
        rc = dataclasses.replace(rc, rollout_is="token", rollout_is_threshold=cap)
    elif rc.rollout_is_threshold <= 0:
        raise ConfigError(f"algorithm.rollout_correction.rollout_is_threshold must be > 0, got "
                          f"{rc.rollout_is_threshold}")
    _check_rejection_bounds(rc)
    return rc


def _check_rejection_bounds(rc: RolloutCorrectionConfig) -> None:
    """Rejection keeps ratios in [lower, upper], which needs lower <= upper: refused at launch
    rather than by the trainer's first update (non-positive bounds are left to the range
    check, which names the key)."""
    if rc.rollout_rs is None:
        return
    upper = rc.rollout_rs_threshold if rc.rollout_rs_threshold is not None else rc.rollout_is_threshold
    if not upper > 0 or (rc.rollout_rs_threshold_lower is not None and not rc.rollout_rs_threshold_lower > 0):
        return
    lower = rc.rollout_rs_threshold_lower if rc.rollout_rs_threshold_lower is not None else 1.0 / upper
    if lower > upper:
        raise ConfigError(f"algorithm.rollout_correction rejects ratios outside [lower, upper], but lower={lower:g} "
                          f"is above upper={upper:g} (rollout_rs_threshold, else rollout_is_threshold; "
                          f"rollout_rs_threshold_lower, else 1 / upper). Give rollout_rs_threshold_lower <= rollout_rs_threshold")


def _refuse_credentials(flat: dict[str, Any]) -> None:
    """The config travels with the run (Flyte inputs and decks, MLflow params, checkpoints), so a
    URI in it may not carry a password; credentials come from the environment or Flyte Secrets."""
    from rlhf.tracking.sinks import URI_PASSWORD, redact

    for key, value in flat.items():
        if isinstance(value, str) and URI_PASSWORD.search(value):
            raise ConfigError(
                f"config key '{key}' holds a password in its URI ({redact(value)}); the config is stored with the "
                "run (Flyte inputs, MLflow params, checkpoints), so remove it and pass credentials through the "
                "environment or a Flyte Secret: MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or "
                "MLFLOW_TRACKING_TOKEN for MLflow, the storage's own variables (e.g. AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY) for data and models")


def rounds_for_epochs(cfg: PPOConfig, n_train: int) -> int:
    """Rounds that make `trainer.total_epochs` passes over `n_train` train prompts (verl's
    `total_epochs`): ceil(epochs * n_train / (train_batch_size * steps_per_round))."""
    per_round = cfg.data.train_batch_size * cfg.trainer.steps_per_round
    if n_train <= 0:
        raise ConfigError("trainer.total_epochs needs a non-empty train set; check data.train_files")
    return max(1, math.ceil(cfg.trainer.total_epochs * n_train / per_round))


def resolve_epochs(cfg: PPOConfig, n_train: int) -> PPOConfig:
    """`cfg` itself, or (with `trainer.total_epochs` > 0) a new config whose `trainer.total_rounds`
    makes that many passes over the `n_train` train prompts and whose `total_epochs` is 0, so
    resolving again changes nothing. Called where the train set is prepared."""
    if cfg.trainer.total_epochs <= 0:
        return cfg
    rounds = rounds_for_epochs(cfg, n_train)
    trainer = dataclasses.replace(cfg.trainer, total_rounds=rounds, total_epochs=0)
    return dataclasses.replace(cfg, trainer=trainer)


@dataclass(frozen=True)
class Sizes:
    """Batch sizes derived from the config for a given world size."""

    world_size: int
    prompts_per_step: int  # data.train_batch_size
    responses_per_step: int  # prompts_per_step * rollout.n
    prompts_per_round: int  # steps_per_round * train_batch_size
    responses_per_round: int
    num_mini_batches: int  # per PPO epoch, per step
    mini_batch_responses: int  # global responses per optimizer step
    mini_batch_per_gpu: int  # responses per optimizer step on one rank
    micro_batch_per_gpu: int  # responses per forward/backward (fixed bsz)
    grad_accum_steps: int  # micro-batches per optimizer step (fixed bsz)
    responses_per_gpu: int  # responses of one step handled by one rank


def derive_sizes(cfg: PPOConfig, world_size: int | None = None) -> Sizes:
    """The one place batch sizes are derived; every divisibility rule is checked here."""
    ws = world_size if world_size is not None else cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if ws <= 0:
        raise ConfigError(f"world size must be > 0, got {ws}")
    bsz, n = cfg.data.train_batch_size, cfg.rollout.n
    mini = cfg.actor.ppo_mini_batch_size
    if mini > bsz or bsz % mini:
        raise ConfigError(
            f"actor.ppo_mini_batch_size ({mini}) must divide data.train_batch_size ({bsz}); "
            f"try a divisor such as {_divisor_near(bsz, mini)}")
    mini_resp = mini * n
    if mini_resp % ws:
        raise ConfigError(
            f"actor.ppo_mini_batch_size * rollout.n ({mini} * {n} = {mini_resp}) must be divisible by the "
            f"number of GPUs ({ws}); change actor.ppo_mini_batch_size or trainer.n_gpus_per_node")
    mini_per_gpu = mini_resp // ws
    micro = cfg.actor.ppo_micro_batch_size_per_gpu
    if not cfg.actor.use_dynamic_bsz:
        if micro > mini_per_gpu:
            micro = mini_per_gpu  # one micro-batch holds the whole per-GPU mini-batch
        if mini_per_gpu % micro:
            raise ConfigError(
                f"actor.ppo_micro_batch_size_per_gpu ({micro}) must divide the per-GPU mini-batch "
                f"(ppo_mini_batch_size * rollout.n / n_gpus = {mini_per_gpu}); "
                f"try {_divisor_near(mini_per_gpu, micro)}")
    min_tokens = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu < min_tokens:
        raise ConfigError(
            f"actor.ppo_max_token_len_per_gpu ({cfg.actor.ppo_max_token_len_per_gpu}) must hold one full "
            f"sequence (max_prompt_length + max_response_length = {min_tokens}); raise it")
    return Sizes(
        world_size=ws,
        prompts_per_step=bsz,
        responses_per_step=bsz * n,
        prompts_per_round=bsz * cfg.trainer.steps_per_round,
        responses_per_round=bsz * n * cfg.trainer.steps_per_round,
        num_mini_batches=bsz // mini,
        mini_batch_responses=mini_resp,
        mini_batch_per_gpu=mini_per_gpu,
        micro_batch_per_gpu=micro,
        grad_accum_steps=mini_per_gpu // micro if not cfg.actor.use_dynamic_bsz else 0,
        responses_per_gpu=bsz * n // ws,
    )


def _divisor_near(total: int, want: int) -> int:
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), -d))
