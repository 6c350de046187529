"""Rollout engines, chosen by `rollout.name` through the `ENGINES` registry.

- "hf": `HFRolloutEngine`, a transformers model in this process (CPU or one GPU).
- "hf_fast": `FastHFRolloutEngine`, its own decode loop with a static KV cache (CUDA graphs on GPU).
- "vllm": `VLLMRolloutEngine` from `rlhf.rollout.vllm`, imported only when asked for.
"""

from __future__ import annotations

from typing import Callable

from rlhf.config.schema import RolloutConfig
from rlhf.config.registry import Registry
from rlhf.models.load import load_causal_lm
from rlhf.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from rlhf.rollout.hf import HFRolloutEngine

EngineFactory = Callable[..., RolloutEngine]
ENGINES: Registry[EngineFactory] = Registry("rollout engine")

__all__ = ["ENGINES", "RolloutBatch", "RolloutEngine", "SamplingParams", "make_engine"]


@ENGINES.register("hf")
def _make_hf(model_dir: str, tokenizer, cfg: RolloutConfig, model=None, seed: int = 0,
             device: str = "auto", dtype: str = "float32", trust_remote_code: bool = False,
             allow_network: bool = False) -> RolloutEngine:

    if model is None:
        model = load_causal_lm(model_dir, dtype=dtype, trust_remote_code=trust_remote_code,
                               allow_network=allow_network)
    return HFRolloutEngine(model, tokenizer, batch_size=cfg.generate_batch_size, device=device, seed=seed)


@ENGINES.register("hf_fast")
def _make_hf_fast(model_dir: str, tokenizer, cfg: RolloutConfig, model=None, seed: int = 0,
                  device: str = "auto", dtype: str = "float32", trust_remote_code: bool = False,
                  allow_network: bool = False) -> RolloutEngine:
    # static KV cache + CUDA graphs on GPU; loads triton, so only when asked for
    from rlhf.rollout.fast_decode import FastHFRolloutEngine  # loads triton: only when asked for

    if model is None:
        model = load_causal_lm(model_dir, dtype=dtype, trust_remote_code=trust_remote_code,
                               allow_network=allow_network)
    return FastHFRolloutEngine(model, tokenizer, batch_size=cfg.generate_batch_size, device=device, seed=seed)


@ENGINES.register("vllm")
def _make_vllm(model_dir: str, tokenizer, cfg: RolloutConfig, model=None, seed: int = 0,
               device: str = "auto", dtype: str = "float32", trust_remote_code: bool = False,
               allow_network: bool = False) -> RolloutEngine:
    from rlhf.rollout.vllm import open_engine  # heavy; only when asked for

    return open_engine(model_dir, cfg, seed, dtype=dtype, trust_remote_code=trust_remote_code)


def make_engine(name: str, model_dir: str, tokenizer, cfg: RolloutConfig, model=None, seed: int = 0,
                device: str = "auto", dtype: str = "float32", trust_remote_code: bool = False,
                allow_network: bool = False) -> RolloutEngine:
    """The engine registered as `name`; "hf" uses `model` when given, else loads `model_dir`.

    vLLM always loads `model_dir` itself (its weights live in its own workers), in `dtype`
    (`model.dtype`, so rollout and trainer compute in the same precision) and running the
    checkpoint's own code only with `trust_remote_code` (`model.trust_remote_code`).
    """
    return ENGINES.get(name)(model_dir, tokenizer, cfg, model=model, seed=seed, device=device, dtype=dtype,
                             trust_remote_code=trust_remote_code, allow_network=allow_network)
