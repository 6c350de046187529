"""DeepSpeed engines for the actor and the critic, built from the config.

Gradient accumulation is owned by the caller (`managed_gradient_accumulation: false`):
every `backward` accumulates, and `step()` is the boundary that reduces across ranks
and applies the optimizer. That lets a mini-batch hold a variable number of
micro-batches (`use_dynamic_bsz`) and lets a non-finite step be skipped.
"""

from __future__ import annotations

from typing import Iterator

import torch

from rlhf.config.schema import PPOConfig
from rlhf.trainer.deepspeed_internals import consolidated_16bit_state_dict
from rlhf.models.attention import use_varlen_attention
from rlhf.trainer.dist import all_reduce_max, drop_stale_deepspeed_groups
from rlhf.trainer.ds_ops import prepare_cpu_comm
from rlhf.trainer.master_adam import MasterAdamW


def ds_config(cfg: PPOConfig, lr: float, weight_decay: float, grad_clip: float, micro: int,
              device: torch.device) -> dict:
    zero: dict = {"stage": cfg.deepspeed.zero_stage}
    if cfg.deepspeed.offload and cfg.deepspeed.zero_stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        if cfg.deepspeed.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    adam = {"lr": lr, "weight_decay": weight_decay, "betas": [0.9, 0.999], "eps": 1e-8}
    if device.type == "cpu" or not cfg.deepspeed.offload:
        # torch's AdamW: on CPU DeepSpeed's FusedAdam would JIT-compile for minutes; on a GPU
        # torch's fused kernel (one launch per parameter group) needs no build either.
        adam["torch_adam"] = True
        if device.type == "cuda":
            adam["fused"] = True
    return {
        "train_micro_batch_size_per_gpu": max(1, micro),
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "optimizer": {"type": "AdamW", "params": adam},
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.deepspeed.bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer runs in the module's forward pre-hook and, from its
        # second step on, calls torch.cuda.synchronize() there: a stall in every training
        # forward, and an error when a rollout engine captures a CUDA graph of that same
        # module (hf_fast shares the trainer's actor). The run times its stages itself.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }


def gradient_checkpointing(cfg: PPOConfig, critic: bool) -> bool:
    """Whether the actor (`model.enable_gradient_checkpointing`) or the critic
    (`critic.enable_gradient_checkpointing`, null => the actor's) recomputes its activations."""
    own = cfg.critic.enable_gradient_checkpointing if critic else None
    return cfg.model.enable_gradient_checkpointing if own is None else own


def prepare_module(module: torch.nn.Module, cfg: PPOConfig) -> torch.nn.Module:
    """Ready a policy or critic (a `ValueModel`: a `backbone` and a value head) for the update
    before `build_engine`: activation checkpointing when `gradient_checkpointing` says so
    (recompute each layer in backward, about a third more compute for a fraction of the
    activation memory; the result is the same), and variable-length attention for packed
    micro-batches when `data.use_sequence_packing`."""
    is_critic = hasattr(module, "backbone")
    hf = getattr(module, "backbone", module)  # the critic's transformer
    if gradient_checkpointing(cfg, is_critic) and hasattr(hf, "gradient_checkpointing_enable"):
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.data.use_sequence_packing:
        use_varlen_attention(hf)
    return module


OWN_MASTER_WEIGHTS = True  # bf16 at ZeRO stage 0: MasterAdamW instead of DeepSpeed's unfused wrapper


def build_engine(model: torch.nn.Module, ds_cfg: dict):
    """A DeepSpeed engine for `model`. With bf16 at ZeRO stage 0 the float32 master weights
    and their AdamW step are `MasterAdamW`'s (fused), given to DeepSpeed as a client optimizer
    in float32 mode; with one rank the engine skips its (identity) gradient all-reduce."""
    import deepspeed

    drop_stale_deepspeed_groups()
    prepare_cpu_comm()  # no JIT build of the CPU shared-memory op, which can hang on a stale lock
    params = [p for p in model.parameters() if p.requires_grad]
    ds_cfg, optimizer = _client_master_optimizer(ds_cfg, params)
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_cfg, optimizer=optimizer,
                                           model_parameters=None if optimizer is not None else params)
    if engine.zero_optimization_stage() == 0 and engine.dp_world_size == 1:
        engine.enable_backward_allreduce = False
    return engine


def _client_master_optimizer(ds_cfg: dict, params: list) -> tuple[dict, object]:
    """(config, None) unchanged, or for bf16 at stage 0 the float32-mode config and a MasterAdamW."""
    bf16 = ds_cfg.get("bf16", {}).get("enabled", False)
    if not (OWN_MASTER_WEIGHTS and bf16 and ds_cfg["zero_optimization"]["stage"] == 0):
        return ds_cfg, None
    adam = ds_cfg["optimizer"]["params"]
    opt = MasterAdamW(params, lr=adam["lr"], betas=adam["betas"], eps=adam["eps"],
                      weight_decay=adam["weight_decay"], max_grad_norm=ds_cfg.get("gradient_clipping", 0.0))
    cfg = {k: v for k, v in ds_cfg.items() if k != "optimizer"}
    cfg.update(bf16={"enabled": False}, gradient_clipping=0.0)  # the parameters stay bf16; clipping is the optimizer's
    # Without DeepSpeed's bf16 mode its all-reduce would cast the bf16 gradients to float32
    # (twice the bytes); reduce them in bf16, as that mode does.
    cfg.setdefault("communication_data_type", "bf16")
    return cfg, opt


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """The engine's module weights, gathered when ZeRO-3 partitions them (rank 0 gets them)."""
    if engine.zero_optimization_stage() == 3:
        return consolidated_16bit_state_dict(engine)
    return {k: v.detach() for k, v in engine.module.state_dict().items()}


def named_weights(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's module weights by name, on every rank, without a copy, for a rollout engine
    to load from memory (vLLM takes the Hugging Face names). Under ZeRO-3 each module's
    parameters are gathered while they are read: a collective, so every rank iterates."""
    module = engine.module
    if engine.zero_optimization_stage() != 3:
        for name, tensor in module.state_dict().items():
            yield name, tensor.detach()
        return
    import deepspeed  # heavy; only under ZeRO-3

    for prefix, sub in module.named_modules():
        params = list(sub.named_parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            for name, p in params:
                yield (f"{prefix}.{name}" if prefix else name), p.detach()


class NonFiniteGuard:
    """Flags a non-finite gradient in any parameter during backward where ZeRO 2/3 moves the
    gradients out of `param.grad` (the hook sees each gradient before DeepSpeed reduces or
    partitions it). At ZeRO 0/1 it does nothing: the gradient norm `local_grad_norm` takes
    before the step is non-finite exactly when a gradient is, and a hook per parameter per
    micro-batch costs host time that starves the GPU in backward."""

    def __init__(self, engine):
        module = getattr(engine, "module", engine)
        p0 = next(module.parameters())
        self.flag = torch.zeros((), dtype=torch.float32, device=p0.device)
        watch = not hasattr(engine, "zero_optimization_stage") or engine.zero_optimization_stage() >= 2
        self._handles = [p.register_hook(self._check) for p in module.parameters() if p.requires_grad and watch]

    def _check(self, grad: torch.Tensor) -> torch.Tensor:
        # max |g| is one fused reduction; it is NaN or inf exactly when some element is
        self.flag = torch.maximum(self.flag, torch.linalg.vector_norm(grad, float("inf")))
        return grad

    def reset(self) -> None:
        self.flag = torch.zeros_like(self.flag)

    def tripped(self) -> bool:
        if not self._handles:
            return False
        return bool(all_reduce_max((~torch.isfinite(self.flag)).float()).item() > 0)


def local_grad_norm(engine) -> float | None:
    """Pre-clip norm of this rank's accumulated gradients, where they live in `param.grad`
    (ZeRO 0/1 before `step()`); None where ZeRO 2/3 has already moved them."""
    if engine.zero_optimization_stage() >= 2:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads)  # one fused launch per dtype/device group, float32 accumulation
    return float(torch.linalg.vector_norm(torch.stack([n.float() for n in norms])))


def skip_step(engine) -> None:
    """Drop accumulated gradients without applying them."""
    if engine.zero_optimization_stage() >= 1 and hasattr(engine.optimizer, "zero_grad"):
        engine.optimizer.zero_grad(set_to_none=True)
    engine.zero_grad()
