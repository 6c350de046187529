"""The configuration tree: `PPOConfig` and its sections, and the names of its keys.

Field names follow verl's dotted keys (`actor.clip_ratio`, `algorithm.kl_ctrl.kl_coef`,
...) so a verl config carries over. Every section is a frozen dataclass; the comment
beside a field is its documentation (`rlhf.config.doc` renders docs/CONFIG.md from it).
`_CHOICES` and `_LOGGERS` list the values the string keys accept; `all_keys`,
`_key_names` and `_hint` list the dotted keys and name the closest one to a misspelling.
`to_dict` and `flatten` give the tree as plain data. `rlhf.config.decoding` gives
`PPOConfig` the hooks flytekit decodes a config input with (installed by `rlhf.config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional, get_type_hints


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
    train_files: list[str] = field(default_factory=list)  # parquet files/dirs/URIs (verl layout), read and concatenated, each row keeping its data_source; [] => synthetic arithmetic
    val_files: list[str] = field(default_factory=list)  # validation parquet(s) (same layout); required with train_files
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
    enable_gradient_checkpointing: bool = False  # recompute the actor's activations in backward (less memory; the critic too unless critic.enable_gradient_checkpointing says otherwise)
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank on the actor (peft), the base weights frozen; 0 => off (verl)
    lora_alpha: int = 16  # LoRA scaling: an adapter adds (lora_alpha / lora_rank) x B A to its layer's weight
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # layers given adapters: all-linear (every linear layer but the LM head) or module names (peft matches a name or a suffix)
    exclude_modules: Optional[str] = None  # a regex (full match on the module path) of layers left without adapters
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


@dataclass(frozen=True)
class ActorConfig:
    lr: float = 2e-4  # actor learning rate (AdamW)
    weight_decay: float = 0.0  # actor AdamW weight decay
    ppo_epochs: int = 1  # passes over each step's batch (verl's default)
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
    ppo_epochs: int = 1  # passes over each step's batch (verl's default)
    cliprange_value: float = 0.5  # value clipping range around the old values
    grad_clip: float = 1.0  # max gradient norm
    loss_agg_mode: str = "token-mean"  # aggregation of the value loss
    ppo_micro_batch_size_per_gpu: int = 64  # responses per critic forward/backward
    enable_gradient_checkpointing: Optional[bool] = None  # recompute the critic's activations in backward; null => model.enable_gradient_checkpointing
    lora_rank: int = 0  # > 0: LoRA adapters of this rank on the critic's backbone, its value head trained in full; 0 => off
    lora_alpha: int = 16  # critic LoRA scaling (lora_alpha / lora_rank)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # critic layers given adapters (as model.target_modules)
    exclude_modules: Optional[str] = None  # a regex of critic layers left without adapters


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
    max_num_seqs: int = 256  # vLLM sequences in flight (at most max_num_batched_tokens)
    free_cache_engine: bool = True  # vLLM sleeps (KV cache and weights freed) while the trainer updates; woken with the new weights
    enforce_eager: bool = False  # vLLM without CUDA graphs or torch.compile (faster start, slower decode)
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
    table) differ from the trainer's: verl 0.9.1's `algorithm.rollout_correction`, key for
    key (`rlhf.config.correction` parses it, `rlhf.algos.correction` computes it). On by
    default as token-level truncated IS at 2.0 (verl's `decoupled_token_is`, TRL's
    default-on vLLM correction): when the engines agree the weights are 1 and nothing
    changes; when they do not (bf16 or vLLM kernels, stale or offline data) the bias is
    corrected. The thresholds are strings because verl's may be "lower_upper"."""

    preset: str = ""  # one of verl's RolloutCorrectionConfig presets, e.g. decoupled_seq_is_rs; "" => the fields below
    rollout_is: Optional[str] = "token"  # IS weights: "token" | "sequence" | null (off)
    rollout_is_threshold: Optional[str] = "2.0"  # a number (truncation cap) or a quoted 'lower_upper' (IcePop, e.g. '0.5_5.0')
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean
    rollout_rs: Optional[str] = None  # rejection criteria, comma-separated: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3; null (off)
    rollout_rs_threshold: Optional[str] = None  # one per criterion or one for all, comma-separated; k1: 'lower_upper' or upper (lower 1/upper)
    bypass_mode: bool = False  # PPO anchored at the rollout log-probs; correction computed in the loss against the current policy
    loss_type: str = "ppo_clip"  # bypass mode's policy loss: "ppo_clip" | "reinforce" (IS-weighted, no clipping)


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
    total_epochs: int = 0  # > 0: epochs of floor(train rows / train_batch_size) steps (verl's count); sets total_rounds once the train set's size is known
    steps_per_round: int = 1  # PPO steps per rollout buffer (1 => on-policy)
    test_freq: int = 1  # evaluate every k rounds and after the last; -1 => never after training starts (val_before_train still validates first, as verl)
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
    save_freq: int = 5  # rounds between checkpoints (plus one after the last round and at an early stop); -1 => no checkpoint, as verl (the final policy is still written)
    granularity: str = "segment"  # Flyte rounds: "segment" (K rounds per GPU task; real sizes) | "stage" (task per stage)
    rounds_per_segment: int = 10  # K: rounds one colocated Flyte segment runs (granularity=segment)
    save_merged: bool = False  # with model.lora_rank > 0: write the actor with its adapters merged in (a plain model directory) to <output_dir>/merged_policy at the end; the Flyte pipeline's model output is then that merged model


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
    defaults: str = "project"  # whose defaults the unset keys took: "project" (docs/CONFIG.md) | "verl" (verl 0.9.1's; chosen when the launch uses verl's key names, docs/VERL.md)
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


_CHOICES: dict[str, tuple[str, ...]] = {
    "defaults": ("project", "verl"),
    "data.prompt_format": ("text", "chat"),
    "data.truncation": ("error", "left", "right"),
    "model.dtype": ("float32", "bfloat16"),
    "model.sft.lr_schedule": ("constant", "cosine"),
    "rollout.name": ("hf", "hf_fast", "vllm"),
    "algorithm.adv_estimator": ("gae", "grpo", "rloo", "reinforce_plus_plus_baseline"),
    "algorithm.rollout_correction.rollout_is": (None, "token", "sequence"),
    "algorithm.rollout_correction.loss_type": ("ppo_clip", "reinforce"),
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
# Key names
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


# ---------------------------------------------------------------------------------
# The tree as plain data
# ---------------------------------------------------------------------------------


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def get_dotted(tree: dict, key: str) -> Any:
    """`tree["a"]["b"]` for key "a.b"."""
    node: Any = tree
    for part in key.split("."):
        node = node[part]
    return node


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

