"""Rollout throughput of the HF engines against plain `model.generate` and the decode roofline.

One call, one model, one workload: `--prompts` prompts (realistic length spread) x `--n`
samples x up to `--max-tokens` new tokens, all sequences in flight together.

  fast      rlhf.rollout.fast_decode.FastHFRolloutEngine (static KV, packed prefill, CUDA graphs)
  hf        rlhf.rollout.hf.HFRolloutEngine (DynamicCache, eager decode loop)
  generate  model.generate(do_sample=True, num_return_sequences=n) with its defaults otherwise
  vllm      rlhf.rollout.vllm.VLLMRolloutEngine, the same sequences in flight (benchmarks/vllm_rollout.py)

The roofline of a decode step is max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), with
bytes = the weights once + every row's keys and values up to its current length, and FLOPs
= 2 x parameters per row + attention over the row's context; summed over the steps the
rows actually ran.

    python benchmarks/rollout_throughput.py --out benchmarks/results/rollout_throughput_h200.json
    python benchmarks/rollout_throughput.py --tiny       # CPU-sized check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

import gpu_common as G  # noqa: E402
import vllm_rollout as V  # noqa: E402


def roofline(model, prompt_lens: list[int], response_lens: list[int]) -> dict:
    """Lower bound on the decode time of this workload (seconds) and its tokens/s."""
    cfg = model.config
    n = G.n_params(model)
    w_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    d = cfg.hidden_size // cfg.num_attention_heads
    kv_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d * next(model.parameters()).element_size()
    attn_tok = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * d  # QK^T and PV per context token
    steps = max(response_lens)
    t_total, t_bytes, t_flops = 0.0, 0.0, 0.0
    for t in range(steps):
        ctx = [p + t for p, r in zip(prompt_lens, response_lens) if r > t]
        if not ctx:
            break
        rows, ctx_sum = len(ctx), sum(ctx)
        b = w_bytes + kv_tok * (ctx_sum + rows)
        f = 2 * n * rows + attn_tok * ctx_sum
        t_b, t_f = b / G.COPY_BANDWIDTH, f / G.PEAK_BF16_FLOPS
        t_total += max(t_b, t_f)
        t_bytes += t_b
        t_flops += t_f
    tokens = sum(response_lens)
    return {"decode_s": t_total, "tokens_per_s": tokens / t_total, "bytes_bound_s": t_bytes,
            "flops_bound_s": t_flops, "tokens": tokens}


def run_engine(name: str, model, tok, prompts, a, device) -> dict:
    from rlhf.rollout.base import SamplingParams

    params = SamplingParams(n=a.n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=a.max_tokens, seed=a.seed)
    if name == "generate":
        return run_generate(model, tok, prompts, a, device)
    if name == "vllm":
        return V.run_vllm(model, tok, prompts, a, device)
    if name.startswith("fast"):
        from rlhf.rollout.fast_decode import FastHFRolloutEngine

        attn = {"fast_sdpa": "sdpa", "fast_triton": "triton", "fast_flash": "flash",
                "fast_per_head": "flash"}.get(name, "auto")
        engine = FastHFRolloutEngine(model, tok, batch_size=a.batch, device=device, seed=a.seed,
                                     cuda_graphs=name != "fast_eager", decode_attention=attn,
                                     group_decode_queries=name != "fast_per_head",
                                     fused_sampling=name != "fast_torch_sampling",
                                     fused_ops=name != "fast_unfused_ops")
    else:
        from rlhf.rollout.hf import HFRolloutEngine

        engine = HFRolloutEngine(model, tok, batch_size=a.batch, device=device, seed=a.seed)
    warm = SamplingParams(n=a.n, temperature=1.0, max_tokens=8, seed=a.seed)
    engine.generate(prompts[: max(1, a.batch // a.n // 8)], warm)
    G.sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    G.sync(device)
    dt = time.perf_counter() - t0
    new = out.num_response_tokens()
    res = {"wall_s": dt, "new_tokens": new, "tokens_per_s": new / dt, "sequences": len(out),
           "response_len_mean": new / len(out), "stop_frac": sum(r == "stop" for r in out.finish_reason) / len(out)}
    res.update({f"engine_{k}": v for k, v in getattr(engine, "stats", {}).items()})
    if "engine_decode_s" in res:
        res["decode_tokens_per_s"] = new / res["engine_decode_s"]
        res["decode_ms_per_step"] = 1e3 * res["engine_decode_s"] / max(res.get("engine_steps", 1), 1)
    res["_response_lens"] = [len(r) for r in out.response_ids]
    return res


def run_generate(model, tok, prompts, a, device) -> dict:
    """Plain `generate`: left-padded batch of all prompts, sampling, n return sequences."""
    from rlhf.rollout.hf import left_pad

    ids, mask = left_pad(prompts, tok.pad_token_id, device)
    kw = dict(do_sample=True, max_new_tokens=a.max_tokens, num_return_sequences=a.n, pad_token_id=tok.pad_token_id,
              eos_token_id=tok.eos_token_id)
    model.generate(input_ids=ids[:4], attention_mask=mask[:4], **{**kw, "max_new_tokens": 8})
    if a.generate_seconds:
        kw["max_time"] = float(a.generate_seconds)
    G.sync(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    G.sync(device)
    dt = time.perf_counter() - t0
    gen = out[:, ids.shape[1]:]
    lens = []
    for row in gen.tolist():  # up to and including the first EOS
        lens.append(next((i + 1 for i, t in enumerate(row) if t == tok.eos_token_id), len(row)))
    new = sum(lens)
    return {"wall_s": dt, "new_tokens": new, "tokens_per_s": new / dt, "sequences": len(lens),
            "response_len_mean": new / len(lens), "_response_lens": lens, "steps_run": gen.shape[1],
            "cut_at_max_time": gen.shape[1] < a.max_tokens,
            "generate_kwargs": {k: v for k, v in kw.items() if k not in ("pad_token_id", "eos_token_id")}}


def agreement(model, tok, prompts, device, max_tokens: int = 24) -> dict:
    """Greedy decoding by the fast and the plain HF engine on a few prompts: identical token
    fraction and the largest gap between their log-probs over the common prefix."""
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.fast_decode import FastHFRolloutEngine
    from rlhf.rollout.hf import HFRolloutEngine

    p = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    a = HFRolloutEngine(model, tok, batch_size=len(prompts), device=device).generate(prompts, p)
    out = {}
    for attn in ("auto", "sdpa"):
        b = FastHFRolloutEngine(model, tok, batch_size=len(prompts), device=device, decode_attention=attn
                                ).generate(prompts, p)
        same = [x == y for ra, rb in zip(a.response_ids, b.response_ids) for x, y in zip(ra, rb)]
        gaps, first = [], []
        for ra, rb, la, lb in zip(a.response_ids, b.response_ids, a.logprobs, b.logprobs):
            k = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
            gaps += [abs(u - v) for u, v in zip(la[:k], lb[:k])]
            first.append(abs(la[0] - lb[0]))
        out[attn] = {"same_token_frac": sum(same) / max(len(same), 1), "max_logprob_gap_common_prefix": max(gaps),
                     "max_first_token_logprob_gap": max(first)}
    return out


def _device_ms(fn, device, reps: int = 20) -> float:
    """Mean milliseconds of `fn()` on `device` (CUDA events; wall clock on a CPU)."""
    for _ in range(3):
        fn()
    G.sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def decode_breakdown(model, prompt_lens: list[int], a, device) -> dict:
    """The parts of one decode step of the workload at half its new tokens (every row's
    context = its prompt + max_tokens / 2): attention of all layers by each kernel,
    sampling from (rows, vocab) logits, and how far the kernels agree."""
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.fast_decode import _decode_flash, _decode_sdpa, _round_up, _Step, flash_available
    from rlhf.rollout.hf import sample_next

    cfg, dtype = model.config, next(model.parameters()).dtype
    hq, hkv, layers = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    d, rows = cfg.hidden_size // hq, a.batch
    lens = [p for p in prompt_lens for _ in range(a.n)][:rows]
    rows = len(lens)
    max_len = max(lens) + a.max_tokens
    g = torch.Generator(device=device).manual_seed(a.seed)
    kc = torch.randn(rows * max_len, hkv, d, generator=g, device=device, dtype=dtype)
    vc = torch.randn(rows * max_len, hkv, d, generator=g, device=device, dtype=dtype)
    q = torch.randn(rows, hq, d, generator=g, device=device, dtype=dtype)
    used = torch.tensor([n + a.max_tokens // 2 for n in lens], dtype=torch.int32, device=device)
    ar = torch.arange(rows + 1, dtype=torch.int32, device=device)
    step = _Step([kc], [vc], rows, max_len, prefill=False, cu_q=ar, cu_k=ar * max_len, used=used,
                 cu_group=ar * (hq // hkv), kv_window=min(max_len, _round_up(int(used.max()), a.kv_window_step)))
    scale = d ** -0.5
    out: dict = {"rows": rows, "mean_context": float(used.float().mean()), "layers": layers}
    ref = _decode_sdpa(q, kc, vc, step, scale)
    out["attention_ms_all_layers"] = {"sdpa": layers * _device_ms(lambda: _decode_sdpa(q, kc, vc, step, scale), device)}
    if flash_available(device):
        for name, group in (("flash_grouped", True), ("flash_per_head", False)):
            st = _Step(**{**step.__dict__, "group": group})
            got = _decode_flash(q, kc, vc, st, scale)
            out[f"{name}_max_abs_diff_vs_sdpa"] = float((got.float() - ref.float()).abs().max())
            out["attention_ms_all_layers"][name] = layers * _device_ms(lambda st=st: _decode_flash(q, kc, vc, st, scale),
                                                                       device)
    from rlhf.rollout.decode_attention import triton_decode
    from rlhf.rollout.triton_support import triton_available

    if triton_available(device):
        got = triton_decode(q, kc, vc, used, max_len, scale)
        out["triton_max_abs_diff_vs_sdpa"] = float((got.float() - ref.float()).abs().max())
        out["attention_ms_all_layers"]["triton"] = layers * _device_ms(
            lambda: triton_decode(q, kc, vc, used, max_len, scale), device)
    kv_bytes = 2 * hkv * d * kc.element_size() * float(used.sum()) * layers
    out["attention_kv_bytes_bound_ms"] = kv_bytes / G.COPY_BANDWIDTH * 1e3
    kc = vc = None  # the caches' memory goes back before the sampling timings
    logits = torch.randn(rows, cfg.vocab_size, generator=g, device=device, dtype=dtype)
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=1)
    out["sampling_ms"] = {"sample_next": _device_ms(lambda: sample_next(logits, params, g), device)}
    from rlhf.rollout.fused_sampling import fused_sample

    if triton_available(device):
        out["sampling_ms"]["fused"] = _device_ms(lambda: fused_sample(logits, 1.0, g), device)
        tok, lp = fused_sample(logits, 1.0, g)
        ref = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
        out["fused_sampling_max_logprob_gap"] = float((lp - ref).abs().max())
        gtok, _ = fused_sample(logits, 0.0, g)
        out["fused_greedy_equals_argmax"] = bool((gtok == logits.float().argmax(-1)).all())
    return out


def step_profile(model, tok, prompt_lens: list[int], a, device, attention: str, fused_ops: bool) -> dict:
    """One whole decode step of the model at the workload's half-way contexts: eager and
    CUDA-graph milliseconds, and device time per step by kernel (torch.profiler, eager)."""
    from torch.autograd import DeviceType

    from rlhf.rollout.fast_decode import STATIC_KV_ATTENTION, FastHFRolloutEngine, _Step, register_static_kv_attention

    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    lens = [p for p in prompt_lens for _ in range(a.n)][:a.batch]
    rows, max_len = len(lens), max(lens) + a.max_tokens
    dtype = next(model.parameters()).dtype
    engine = FastHFRolloutEngine(model, tok, batch_size=rows, device=device, decode_attention=attention)
    keys = [torch.randn(rows * max_len, hkv, d, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
    values = [torch.randn_like(k) for k in keys]
    used = torch.tensor([n + a.max_tokens // 2 for n in lens], dtype=torch.int32, device=device)
    ar = torch.arange(rows + 1, dtype=torch.int32, device=device)
    step = _Step(keys, values, rows, max_len, prefill=False, flash=engine.flash, triton=engine.triton,
                 cu_q=ar, cu_k=ar * max_len, cu_group=ar * (hq // hkv), write=ar[:-1].long() * max_len + used - 1,
                 used=used)
    tok_in = torch.randint(3, cfg.vocab_size, (rows, 1), device=device)
    pos_in = (used - 1).long()[:, None]
    register_static_kv_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(STATIC_KV_ATTENTION)
    out: dict = {"attention": attention, "fused_ops": fused_ops, "rows": rows}
    from rlhf.rollout.fused_ops import fused_decode_ops

    fused = fused_decode_ops(model) if fused_ops else contextlib.nullcontext()
    try:
        with torch.no_grad(), fused:
            out["eager_ms"] = _device_ms(lambda: engine._forward(step, tok_in, pos_in), device, reps=5)
            graph, _ = engine._capture(step, tok_in, pos_in)
            out["graph_ms"] = _device_ms(graph.replay, device, reps=10)
            del graph
            steps = 3
            acts = [torch.profiler.ProfilerActivity.CPU] + \
                ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(steps):
                    engine._forward(step, tok_in, pos_in)
                G.sync(device)
    finally:
        model.set_attn_implementation(previous)
    per: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            t = per.setdefault(e.name, [0.0, 0])
            t[0] += e.time_range.elapsed_us() / 1e3 / steps
            t[1] += 1
    kinds = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for name, (ms, _) in per.items():
        low = name.lower()
        kind = "attention" if ("flash" in low or "decode_kernel" in low or "fmha" in low) else \
            "gemm" if any(k in low for k in ("gemm", "xmma", "nvjet", "cutlass", "sm90", "cublas")) else "other"
        kinds[kind] += ms
    out["device_ms_by_kind"] = kinds
    out["top_kernels_ms_per_step"] = [{"name": n[:120], "ms": round(v[0], 4), "calls": v[1] // steps}
                                      for n, v in sorted(per.items(), key=lambda kv: -kv[1][0])[:18]]
    return out


def diagnostics(result: dict, model, tok, prompts, p_lens, a, device) -> None:
    """Greedy agreement of the HF engines, the decode-step breakdown and step profiles."""
    try:
        result["agreement_greedy"] = agreement(model, tok, prompts[:16], device)
    except Exception as e:
        result["agreement_greedy"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    try:
        result["decode_breakdown"] = decode_breakdown(model, p_lens, a, device)
    except Exception as e:
        result["decode_breakdown"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print("decode_breakdown", json.dumps(result["decode_breakdown"])[:800], flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        result["step_profile"] = {}
        for attention, fused_ops in (("triton", True), ("triton", False), ("flash", False)):
            key = attention + ("+fused_ops" if fused_ops else "")
            try:
                result["step_profile"][key] = step_profile(model, tok, p_lens, a, device, attention, fused_ops)
            except Exception as e:
                result["step_profile"][key] = {"error": f"{type(e).__name__}: {e}",
                                               "traceback": traceback.format_exc()[-3000:]}
            print("step_profile", key, json.dumps(result["step_profile"][key])[:1500], flush=True)
            torch.cuda.empty_cache()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.5b", choices=sorted(G.SHAPES))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--engines", default="fast,fast_unfused_ops,fast_torch_sampling,fast_flash,fast_sdpa,generate")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--rollout-n", dest="n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=1024, help="sequences in flight (engine batch_size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-window-step", type=int, default=128)
    p.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                   help="engines only (no agreement, decode breakdown or step profiles)")
    p.add_argument("--generate-seconds", type=float, default=60.0,
                   help="cut plain generate after this many seconds (generate's max_time); 0 => run to the end")
    p.add_argument("--out", default="benchmarks/results/rollout_throughput.json")
    V.add_args(p)
    a = p.parse_args(argv)
    if a.tiny:
        a.model, a.prompts, a.max_prompt, a.max_tokens, a.batch = "tiny", 8, 24, 16, 32
        a.generate_seconds = 0
    return a


def main(argv=None) -> None:
    a = parse(argv)
    device = G.pick_device(a.tiny)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    model = G.build_policy(a.model, device, dtype).eval()
    tok = G.synthetic_tokenizer(model.config.vocab_size)
    p_lens, _ = G.sample_lengths(a.prompts, 1, a.max_prompt, 2, seed=a.seed, min_response=1)
    g = torch.Generator().manual_seed(a.seed)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in p_lens]
    result = {"benchmark": "rollout_throughput", "env": G.environment(device), "model": a.model,
              "n_params": G.n_params(model), "workload": {"prompts": a.prompts, "n": a.n, "max_tokens": a.max_tokens,
                                                          "sequences_in_flight": a.batch,
                                                          "prompt_len_mean": sum(p_lens) / len(p_lens),
                                                          "prompt_len_max": max(p_lens)},
              "peak_bf16_flops": G.PEAK_BF16_FLOPS, "copy_bandwidth": G.COPY_BANDWIDTH, "engines": {}}
    if a.diagnostics:
        diagnostics(result, model, tok, prompts, p_lens, a, device)
    for name in [e for e in a.engines.split(",") if e]:
        try:
            r = run_engine(name, model, tok, prompts, a, device)
            rl = roofline(model, [p for p in p_lens for _ in range(a.n)], r.pop("_response_lens"))
            r["decode_fraction_of_roofline"] = (rl["decode_s"] / r["engine_decode_s"]) if "engine_decode_s" in r \
                else None
            r["roofline"], r["fraction_of_roofline_end_to_end"] = rl, rl["decode_s"] / r["wall_s"]
            if device.type == "cuda":
                r["peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
                torch.cuda.reset_peak_memory_stats(device)
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result["engines"][name] = r
        print(name, json.dumps({k: v for k, v in r.items() if k != "traceback"})[:600], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        G.write_json(a.out, result)
    tps = {k: v.get("tokens_per_s") for k, v in result["engines"].items()}
    summary = {"tokens_per_s": tps, **{f"fast_over_{k if k == 'generate' else 'hf_engine'}": tps["fast"] / tps[k]
                                       for k in ("generate", "hf") if tps.get("fast") and tps.get(k)}}
    best = max((k for k in tps if k.startswith("fast") and tps[k]), key=lambda k: tps[k], default=None)
    if best:
        e = result["engines"][best]
        summary.update(best_fast=best, best_fast_decode_fraction_of_roofline=e.get("decode_fraction_of_roofline"),
                       best_fast_end_to_end_fraction_of_roofline=e.get("fraction_of_roofline_end_to_end"))
    fast = result["engines"].get("fast", {})
    if "fast_over_generate" in summary and fast.get("decode_fraction_of_roofline") is not None:
        summary["fast_decode_fraction_of_roofline"] = fast["decode_fraction_of_roofline"]
        summary["targets"] = {  # the engine's defaults ("fast")
            "fast_over_generate_at_least_3x": summary["fast_over_generate"] >= 3.0,
            "decode_at_least_40pct_of_roofline": fast["decode_fraction_of_roofline"] >= 0.40}
    result["summary"] = {**summary, **V.compare(result)}
    G.write_json(a.out, result)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
