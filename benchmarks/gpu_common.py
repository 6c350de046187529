"""Shared pieces of the GPU benchmarks: model shapes, a synthetic scored batch, timing, and
the provenance every results JSON carries (device, versions, command).

Models are config-only (random init, no weights are downloaded): the throughput of a
transformer step does not depend on the values of its weights, only on shapes and lengths.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

PEAK_BF16_FLOPS = 790e12  # measured dense bf16 matmul rate of one H200 (8192^3, random data)
COPY_BANDWIDTH = 4.3e12  # measured device-to-device copy bandwidth of one H200, bytes read + written

# Qwen2.5 shapes (config.json of the published models); "tiny" runs the same code on a CPU.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,  # head_dim 32:
                 num_key_value_heads=1, vocab_size=512, tie_word_embeddings=True),  # vLLM CPU's smallest
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def qwen_config(shape: str):
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                       attn_implementation="sdpa", use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build_policy(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Qwen2.5-shaped causal LM, built directly on `device`."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen_config(shape))
    return model.to(dtype)


def build_models(shape: str, device: torch.device, dtype: torch.dtype, with_critic: bool = True):
    """(actor, critic or None, frozen reference): the reference and the critic's backbone are
    copies of the actor, as they are at the start of a PPO run."""
    from rlhf.models.load import ValueModel

    actor = build_policy(shape, device, dtype)
    ref = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = ValueModel(copy.deepcopy(actor.model)).to(device) if with_critic else None
    return actor, critic, ref


def n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------------------------
# The synthetic rollout buffer
# ---------------------------------------------------------------------------------------------


def sample_lengths(n_prompts: int, n: int, max_prompt: int, max_response: int, seed: int = 0,
                   min_prompt: int = 16, min_response: int = 32) -> tuple[list[int], list[int]]:
    """Per-response (prompt_len, response_len), `n` responses per prompt.

    Prompts: log-normal around 40% of the maximum (a few near it); responses: log-normal
    around 35% of the maximum, with the long tail clipped at the maximum as truncated
    responses are. This is the spread of a GSM8K/MATH-style round, not a uniform fill."""
    rng = np.random.default_rng(seed)
    p = np.clip(rng.lognormal(np.log(0.4 * max_prompt), 0.5, n_prompts), min_prompt, max_prompt).astype(int)
    r = np.clip(rng.lognormal(np.log(0.35 * max_response), 0.75, n_prompts * n), min_response,
                max_response).astype(int)
    return np.repeat(p, n).tolist(), r.tolist()


def length_stats(prompt_lens: list[int], response_lens: list[int]) -> dict:
    p, r = np.asarray(prompt_lens), np.asarray(response_lens)
    return {"prompt_mean": float(p.mean()), "prompt_max": int(p.max()), "prompt_min": int(p.min()),
            "response_mean": float(r.mean()), "response_max": int(r.max()), "response_min": int(r.min()),
            "response_p50": float(np.median(r)), "response_frac_at_max": float((r == r.max()).mean()),
            "tokens": int(p.sum() + r.sum()), "response_tokens": int(r.sum()),
            "padded_tokens_full_width": int(len(p) * (p.max() + r.max()))}


def scored_buffer(prompt_lens: list[int], response_lens: list[int], n: int, vocab: int, pad_id: int = 0,
                  seed: int = 0):
    """A PPOBatch with random token ids and 0/1 scores, in the trainer's collated layout."""
    from rlhf.trainer.batch import collate

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (lp,), generator=g).tolist() for lp in prompt_lens]
    responses = [torch.randint(3, vocab, (lr,), generator=g).tolist() for lr in response_lens]
    scores = torch.randint(0, 2, (len(prompts),), generator=g).float().tolist()
    groups = [i // n for i in range(len(prompts))]
    return collate(prompts, responses, scores, groups, pad_id), prompts, responses


# ---------------------------------------------------------------------------------------------
# Timing and provenance
# ---------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StageTimer:
    """Wall time and peak allocated memory per named stage, the device synchronised at the edges."""

    device: torch.device
    times: dict[str, float] = field(default_factory=dict)
    peak_gb: dict[str, float] = field(default_factory=dict)
    alloc_retries: dict[str, int] = field(default_factory=dict)  # allocator cache flushes (fragmentation)

    @contextmanager
    def __call__(self, name: str):
        sync(self.device)
        retries = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        t0 = time.perf_counter()
        yield
        sync(self.device)
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            self.peak_gb[name] = max(self.peak_gb.get(name, 0.0), peak)
            now = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
            self.alloc_retries[name] = self.alloc_retries.get(name, 0) + now - retries


def environment(device: torch.device) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node(),
           "device": str(device), "argv": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    for name in ("transformers", "deepspeed", "trl", "accelerate", "datasets", "vllm", "flytekit"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # not installed here
            out[name] = None
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["gpu_count"] = torch.cuda.device_count()
        out["cuda"] = torch.version.cuda
    return out


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str))
    os.replace(tmp, path)


def pick_device(tiny: bool) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    if not tiny:
        raise SystemExit("no GPU here: pass --tiny to run the CPU-sized version")
    return torch.device("cpu")


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer with one token per id ("t123"), so that any id a random model
    samples decodes; <pad>=0, <bos>=1, <eos>=2 as in `qwen_config`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def init_process_group(device: torch.device) -> None:
    """One group that runs collectives on CPU tensors (gloo) and on GPU tensors (NCCL)."""
    import torch.distributed as dist

    if device.type != "cuda" or dist.is_initialized():
        return
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from rlhf.trainer.dist import _free_port

        os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
