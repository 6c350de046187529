"""Runs the rollout's Triton kernels (the one-pass sampler and the decode attention) under
Triton's interpreter (TRITON_INTERPRET=1 must be set before Triton is imported, hence a
process of its own) and prints what tests/test_triton_kernels.py checks, as JSON on the
last line of stdout."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
# The project, and this directory for the test modules it borrows from (by their plain names:
# verl's wheel, installed for the parity tests, ships a `tests` package that would shadow ours).
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

from rlhf.rollout.fused_sampling import BLOCK, fused_applies, fused_sample  # noqa: E402
from rlhf.rollout.triton_support import triton_available  # noqa: E402


def logits_of(rows, vocab, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * scale).to(torch.bfloat16)


def main() -> dict:
    out: dict = {"available_on_cpu": triton_available(torch.device("cpu")), "block": BLOCK}
    out["applies"] = [fused_applies(-1, 1.0, 100), fused_applies(100, 1.0, 100), fused_applies(50, 1.0, 100),
                      fused_applies(-1, 0.9, 100)]
    out["greedy"] = {}
    for vocab in (7, BLOCK, 2 * BLOCK + 3):
        x = logits_of(5, vocab)
        tok, lp = fused_sample(x, 0.0, torch.Generator().manual_seed(0))
        ref = torch.log_softmax(x.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
        out["greedy"][vocab] = {"same_as_argmax": tok.tolist() == x.float().argmax(-1).tolist(),
                                "max_lp_gap": float((lp - ref).abs().max())}
    ties = torch.randint(0, 3, (64, 9000), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tok, _ = fused_sample(ties, 0.0, torch.Generator().manual_seed(0))
    out["greedy_ties_same_as_argmax"] = tok.tolist() == ties.float().argmax(-1).tolist()
    out["sampled"] = {}
    for t in (0.7, 1.0, 1.5):
        x = logits_of(6, 5000, seed=1)
        tok, lp = fused_sample(x, t, torch.Generator().manual_seed(3))
        ref = torch.log_softmax(x.float() / t, -1).gather(-1, tok[:, None]).squeeze(-1)
        out["sampled"][t] = {"max_lp_gap": float((lp - ref).abs().max()), "dtypes": [str(tok.dtype), str(lp.dtype)]}
    row = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0])
    x = row.repeat(4000, 1).to(torch.bfloat16)
    tok, _ = fused_sample(x, 1.5, torch.Generator().manual_seed(7))
    out["freq"] = (torch.bincount(tok, minlength=6).double() / len(tok)).tolist()
    out["softmax"] = torch.softmax(x[0].double() / 1.5, -1).tolist()
    x = logits_of(64, 300, seed=2, scale=0.5)
    a, _ = fused_sample(x, 1.0, torch.Generator().manual_seed(5))
    b, _ = fused_sample(x, 1.0, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    c, _ = fused_sample(x, 1.0, g)
    d, _ = fused_sample(x, 1.0, g)
    out["seeded"] = {"same_seed_same_draws": a.tolist() == b.tolist() == c.tolist(),
                     "generator_moves_on": d.tolist() != c.tolist(),
                     "distinct_tokens_of_64_identical_rows": len(set(fused_sample(x[:1].repeat(64, 1), 1.0, g)[0]
                                                                     .tolist()))}
    out["decode_attention"] = decode_attention_checks()
    out["fused_ops"] = fused_ops_checks()
    out["engine"] = engine_checks()
    return out


def decode_attention_checks() -> dict:
    """The Triton decode attention against the SDPA path, row by row at each row's length."""
    from rlhf.rollout import fast_decode as FD
    from rlhf.rollout.decode_attention import triton_decode

    g = torch.Generator().manual_seed(0)
    res = {}
    for hq, hkv, d in ((12, 2, 32), (4, 4, 16), (8, 1, 64)):
        rows, max_len = 5, 70  # lengths below, at and across the 64-key tile
        kc, vc = (torch.randn(rows * max_len, hkv, d, generator=g) for _ in range(2))
        q = torch.randn(rows, hq, d, generator=g)
        used = torch.tensor([1, 70, 4, 64, 33], dtype=torch.int32)
        ar = torch.arange(rows + 1, dtype=torch.int32)
        step = FD._Step([kc], [vc], rows, max_len, prefill=False, cu_q=ar, cu_k=ar * max_len, used=used)
        want = FD._decode_sdpa(q, kc, vc, step, 0.3)
        got = triton_decode(q, kc, vc, used, max_len, 0.3)
        shuffled = triton_decode(q, kc, vc, used.flip(0), max_len, 0.3)  # lengths matter
        res[f"{hq}/{hkv}/{d}"] = {"max_abs_diff": float((got - want).abs().max()),
                                  "wrong_lengths_diff": float((shuffled - want).abs().max())}
    return res


def fused_ops_checks() -> dict:
    """RMSNorm / SiLU gate / rotary kernels against the transformers code they stand in for."""
    import torch.nn.functional as nnf
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    from rlhf.rollout.fused_ops import fused_decode_ops, rms_norm, rope_one_position, silu_mul
    from test_fast_paths import _qwen

    g = torch.Generator().manual_seed(0)
    res: dict = {}
    x = torch.randn(7, 1, 48, generator=g).to(torch.bfloat16) * 3
    norm = qwen2.Qwen2RMSNorm(48, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(48, generator=g).to(torch.bfloat16)
    res["rms_norm_bf16_max_diff"] = float((rms_norm(x, norm.weight, 1e-6).float() - norm(x).float()).abs().max())
    gate, up = (torch.randn(5, 300, generator=g).to(torch.bfloat16) for _ in range(2))
    res["silu_mul_bf16_max_diff"] = float((silu_mul(gate, up).float() - (nnf.silu(gate) * up).float()).abs().max())
    q = torch.randn(6, 1, 4, 16, generator=g).to(torch.bfloat16).transpose(1, 2)  # (B, H, 1, D) as attention has it
    k = torch.randn(6, 1, 2, 16, generator=g).to(torch.bfloat16).transpose(1, 2)
    ang = torch.rand(6, 1, 8, generator=g) * 6
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    want_q, want_k = qwen2.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = rope_one_position(q, k, cos, sin)
    res["rope_bf16_max_diff"] = max(float((a.float() - b.float()).abs().max())
                                    for a, b in ((got_q, want_q), (got_k, want_k)))
    res["rope_max_abs"] = float(want_q.float().abs().max())
    res["rope_swapped_cos_sin_diff"] = float((rope_one_position(q, k, sin, cos)[0].float() - want_q.float()).abs().max())
    model = _qwen()
    ids, pos = torch.randint(3, 60, (6, 1), generator=g), torch.randint(0, 30, (6, 1), generator=g)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        with fused_decode_ops(model) as counts:
            got = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            prefill = model(input_ids=ids.T, use_cache=False).logits  # 6 positions: the original rotary
        res["swapped"] = counts
        res["model_decode_max_diff"] = float((got - want).abs().max())
        res["model_prefill_max_diff"] = float((prefill - model(input_ids=ids.T, use_cache=False).logits).abs().max())
    res["restored"] = not getattr(qwen2.apply_rotary_pos_emb, "rlhf_fused", False) and \
        not any("forward" in m.__dict__ for m in model.modules())
    return res


def engine_checks() -> dict:
    """FastHFRolloutEngine on a tiny model with the kernel: greedy against the plain engine."""
    from test_fast_paths import _qwen

    from rlhf.models.tokenizer import build_char_tokenizer
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.fast_decode import FastHFRolloutEngine
    from rlhf.rollout.hf import HFRolloutEngine

    tok = build_char_tokenizer()
    model = _qwen(vocab=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=6)
    engine = FastHFRolloutEngine(model, tok, batch_size=6)
    got = engine.generate(prompts, greedy)
    out = {"fused_greedy": engine.stats["fused_sampling"]}
    want = HFRolloutEngine(model, tok, batch_size=6).generate(prompts, greedy)
    out["greedy_same_tokens"] = got.response_ids == want.response_ids
    out["greedy_max_lp_gap"] = max(abs(a - b) for ra, rb in zip(got.logprobs, want.logprobs) for a, b in zip(ra, rb))
    tri = FastHFRolloutEngine(model, tok, batch_size=6, decode_attention="triton")
    got_tri = tri.generate(prompts, greedy)
    out["triton_attention_greedy_same_tokens"] = got_tri.response_ids == want.response_ids
    out["triton_attention_greedy_max_lp_gap"] = max(abs(a - b) for ra, rb in zip(got_tri.logprobs, want.logprobs)
                                                    for a, b in zip(ra, rb))
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=4)
    out["sampled_repeats"] = engine.generate(prompts, sampled).response_ids == engine.generate(prompts, sampled).response_ids
    engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=6, seed=4))
    out["fused_with_top_p"] = engine.stats["fused_sampling"]
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
