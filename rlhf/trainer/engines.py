"""DeepSpeed engines for the actor and the critic, built from the config.

Gradient accumulation is owned by the caller (`managed_gradient_accumulation: false`):
every `backward` accumulates, and `step()` is the boundary that reduces across ranks
and applies the optimizer. That lets a mini-batch hold a variable number of
micro-batches (`use_dynamic_bsz`) and lets a non-finite step be skipped.
"""

from __future__ import annotations

import torch

from rlhf.config import PPOConfig


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
    }


def prepare_module(module: torch.nn.Module, cfg: PPOConfig) -> torch.nn.Module:
    """Ready a policy or critic for the update before `build_engine`: activation checkpointing
    when `model.enable_gradient_checkpointing` (recompute each layer in backward, about a
    third more compute for a fraction of the activation memory), and variable-length
    attention for packed micro-batches when `data.use_sequence_packing`."""
    from rlhf.trainer.forward import use_varlen_attention

    hf = getattr(module, "backbone", module)  # the critic's transformer
    if cfg.model.enable_gradient_checkpointing and hasattr(hf, "gradient_checkpointing_enable"):
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.data.use_sequence_packing:
        use_varlen_attention(hf)
    return module


def build_engine(model: torch.nn.Module, ds_cfg: dict):
    import deepspeed

    from rlhf.trainer.dist import drop_stale_deepspeed_groups

    drop_stale_deepspeed_groups()
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_cfg,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    return engine


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """The engine's module weights, gathered when ZeRO-3 partitions them (rank 0 gets them)."""
    if engine.zero_optimization_stage() == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return {k: v.detach() for k, v in engine.module.state_dict().items()}


class NonFiniteGuard:
    """Flags a non-finite gradient in any parameter during backward, on every ZeRO stage
    (the hook sees the gradient before DeepSpeed reduces or partitions it)."""

    def __init__(self, module: torch.nn.Module):
        p0 = next(module.parameters())
        self.flag = torch.zeros((), dtype=torch.bool, device=p0.device)
        self._handles = [p.register_hook(self._check) for p in module.parameters() if p.requires_grad]

    def _check(self, grad: torch.Tensor) -> torch.Tensor:
        self.flag |= ~torch.isfinite(grad).all()
        return grad

    def reset(self) -> None:
        self.flag.zero_()

    def tripped(self) -> bool:
        from rlhf.trainer.dist import all_reduce_max

        return bool(all_reduce_max(self.flag.to(torch.float32)).item() > 0)


def local_grad_norm(engine) -> float | None:
    """Pre-clip norm of this rank's accumulated gradients, where they live in `param.grad`
    (ZeRO 0/1 before `step()`); None where ZeRO 2/3 has already moved them."""
    if engine.zero_optimization_stage() >= 2:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def skip_step(engine) -> None:
    """Drop accumulated gradients without applying them."""
    if engine.zero_optimization_stage() >= 1 and hasattr(engine.optimizer, "zero_grad"):
        engine.optimizer.zero_grad(set_to_none=True)
    engine.zero_grad()
