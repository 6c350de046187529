"""The `check` and `attn_check` variants of benchmarks/update_throughput.py: the fast paths'
log-probs and gradients against the model's own forward, and the varlen attention against SDPA."""

from __future__ import annotations

import json

import torch

import gpu_common as G


def run_check(a) -> dict:
    """The fast paths against the plain ones on this device: log-probs and gradients of the
    packed (variable-length attention, fused LM head) and padded (SDPA) layouts against the
    model's own logits, on a few sequences of the benchmark's length spread."""
    import inspect

    from rlhf import algos
    from rlhf.trainer import forward as F
    from rlhf.models import attention as A

    device = G.pick_device(a.tiny)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    model = G.build_policy(a.model, device, dtype)
    p_lens, r_lens = G.sample_lengths(4, 4, a.max_prompt, a.max_response, seed=a.seed + 1)
    buf, _, _ = G.scored_buffer(p_lens, r_lens, 4, model.config.vocab_size, seed=a.seed + 1)
    buf = buf.to(device)
    w = torch.randn(buf.response_mask.shape, device=device) * buf.response_mask
    probe = [model.model.layers[0].self_attn.q_proj.weight, model.model.embed_tokens.weight]

    def run(kind):
        model.zero_grad(set_to_none=True)
        if kind == "reference":  # the model's own forward, full logits, SDPA with a padding mask
            model.set_attn_implementation("sdpa")
            R = buf.responses.shape[1]
            logits = model(input_ids=buf.input_ids, attention_mask=buf.attention_mask,
                           position_ids=buf.position_ids, use_cache=False).logits[:, -R - 1:-1].float()
            lp = algos.logprobs_from_logits(logits, buf.responses) * buf.response_mask
        else:
            lp, _ = F.log_probs(model, buf, 1.0, packed=kind == "packed", with_entropy=True)
        sync = G.sync
        (lp * w).sum().backward()
        sync(device)
        return lp.detach(), [p.grad.detach().float().clone() for p in probe]

    ref_lp, ref_g = run("reference")
    out = {"varlen_attn_api": None, "n_tokens": float(buf.attention_mask.sum())}
    try:
        from torch.nn.attention.varlen import varlen_attn

        out["varlen_attn_api"] = str(inspect.signature(varlen_attn))
    except ImportError:
        pass
    for kind in ("padded", "packed"):
        lp, g = run(kind)
        mask = buf.response_mask.bool()
        out[kind] = {"max_abs_logprob_diff": float((lp - ref_lp)[mask].abs().max()),
                     "mean_abs_logprob_diff": float((lp - ref_lp)[mask].abs().mean()),
                     "grad_rel_err": [float((x - y).norm() / y.norm()) for x, y in zip(g, ref_g)]}
    out["flash_varlen_used"] = A._FLASH_OK.get("varlen", True) and device.type == "cuda"
    out["variant"] = "check"
    print(json.dumps(out, indent=1), flush=True)
    return out


def run_attn_check(a) -> dict:
    """The variable-length flash kernel against per-sequence SDPA in float32, and SDPA in bf16 for
    scale: relative error of outputs and of q/k/v gradients, Qwen2.5-1.5B head layout."""
    from rlhf.models import attention as A

    device = G.pick_device(a.tiny)
    torch.manual_seed(0)
    lens = [300, 17, 512, 128, 64, 700]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    T, hq, hkv, d = sum(lens), 12, 2, 128
    q, k, v = (torch.randn(T, h, d, device=device) for h in (hq, hkv, hkv))
    go = torch.randn(T, hq, d, device=device)
    scale = d ** -0.5

    def run(fn, dtype):
        xs = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*xs)
        out.backward(go.to(dtype))
        return [out.float()] + [x.grad.float() for x in xs]

    ref = run(lambda *x: A.varlen_reference(*x, cu.tolist(), scale), torch.float32)
    res = {}
    for name, fn in (("flash_bf16", lambda *x: A.varlen_flash(*x, cu, max(lens), scale)),
                     ("sdpa_bf16", lambda *x: A.varlen_reference(*x, cu.tolist(), scale))):
        try:
            got = run(fn, torch.bfloat16)
            res[name] = {n: float((g - r).norm() / r.norm()) for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    res["variant"] = "attn_check"
    print(json.dumps(res), flush=True)
    return res
