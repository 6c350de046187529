"""A control for the actor update: the same model, packed micro-batches, loss and optimizer
as `PPOTrainer.update_actor`, driven by plain PyTorch (no DeepSpeed engine).

Per micro-batch, CUDA events time the forward (log-probs + entropy + clipped policy loss)
and the backward separately, and each mini-batch's gradient clipping + fused AdamW step;
the same micro-batches are also timed forward-only under `no_grad`. The gap between this
and our engine's `update_actor` on the same work is what the engine's wrapping costs.

Optimizer: torch's fused AdamW either on the bf16 parameters directly (`raw_bf16`, what
TRL's step does with a bf16 model) or on float32 master copies with bf16 compute weights
(`raw_master`, what DeepSpeed's bf16 modes keep).
"""

from __future__ import annotations

import statistics

import torch

import gpu_common as G


class _Master:
    """float32 master weights for bf16 compute weights: grads are cast up, the fused AdamW
    steps the masters, and the result is cast back into the model."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float):
        self.params = params
        self.master = [p.detach().float().clone().requires_grad_(True) for p in params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, fused=True)

    def step(self) -> None:
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float() if p.grad is not None else None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)
        for p in self.params:
            p.grad = None


def run_raw(a, variant: str) -> dict:
    from rlhf import algos
    from rlhf.trainer import forward as F

    device = G.pick_device(a.tiny)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    actor = G.build_policy(a.model, device, dtype)
    F.use_varlen_attention(actor)
    n_actor = G.n_params(actor)
    params = [p for p in actor.parameters() if p.requires_grad]
    master = _Master(params, 1e-6) if variant == "raw_master" else None
    opt = None if master else torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda")

    p_lens, r_lens = G.sample_lengths(a.prompts, a.n, a.max_prompt, a.max_response, seed=a.seed)
    buf, _, _ = G.scored_buffer(p_lens, r_lens, a.n, actor.config.vocab_size, seed=a.seed)
    buf = buf.to(device)
    old = F.batched_log_probs(actor, buf, micro=a.micro, temperature=1.0, packed=True, dynamic=True,
                              max_tokens=a.max_tokens)
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    buf = buf.with_(old_log_probs=old, advantages=torch.randn(buf.response_mask.shape, generator=g).to(device)
                    * buf.response_mask)
    mini_rows = a.mini * a.n
    minis = [buf.select(slice(i, i + mini_rows)) for i in range(0, len(buf), mini_rows)]
    plan = [F.micro_batches(m, a.micro, True, a.max_tokens) for m in minis]
    tokens = float(buf.attention_mask.sum())

    def loss_of(mb):
        lp, ent = F.log_probs(actor, mb, 1.0, packed=True, with_entropy=True)
        pg, _ = algos.policy_loss(lp, mb.old_log_probs, mb.advantages, mb.response_mask, 0.2, 0.2, 3.0,
                                  "token-mean")
        return pg - 0.0 * algos.agg_loss(ent, mb.response_mask, "token-mean")

    def ev():
        return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None

    steps = []
    for it in range(a.warmup + a.steps):
        timer = G.StageTimer(device)
        fwd_ms, bwd_ms, opt_ms = [], [], []
        with timer("forward_only"), torch.no_grad():
            for mbs in plan:
                for mb in mbs:
                    loss_of(mb)
        with timer("update_actor"):
            actor.train()
            for mini, mbs in zip(minis, plan):
                for mb in mbs:
                    e0, e1, e2 = ev(), ev(), ev()
                    e0 and e0.record()
                    loss = loss_of(mb) * (len(mb) / len(mini))
                    e1 and e1.record()
                    loss.backward()
                    e2 and e2.record()
                    fwd_ms.append((e0, e1))
                    bwd_ms.append((e1, e2))
                e3, e4 = ev(), ev()
                e3 and e3.record()
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                if master:
                    master.step()
                else:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                e4 and e4.record()
                opt_ms.append((e3, e4))
        if it >= a.warmup:
            G.sync(device)
            el = (lambda pairs: [s.elapsed_time(e) for s, e in pairs]) if device.type == "cuda" else (lambda p: [])
            steps.append({"times_s": dict(timer.times), "peak_gb": timer.peak_gb,
                          "fwd_ms": el(fwd_ms), "bwd_ms": el(bwd_ms), "opt_ms": el(opt_ms)})
        print(f"[{variant}] step {it}: " + " ".join(f"{k}={v:.2f}s" for k, v in timer.times.items()), flush=True)
    t = {k: statistics.median(s["times_s"][k] for s in steps) for k in steps[0]["times_s"]}
    last = steps[-1]
    out = {"variant": variant, "stage_time_s": t, "tokens_per_step": tokens,
           "micro_batches": [len(m) for m in plan], "stage_peak_allocated_gb": last["peak_gb"],
           "fwd_ms_sum": sum(last["fwd_ms"]), "bwd_ms_sum": sum(last["bwd_ms"]), "opt_ms_sum": sum(last["opt_ms"]),
           "fwd_ms": last["fwd_ms"], "bwd_ms": last["bwd_ms"], "opt_ms": last["opt_ms"],
           "n_params_actor": n_actor, "lengths": G.length_stats(p_lens, r_lens),
           "optimizer": "fp32 master + fused AdamW" if master else "fused AdamW on bf16 params"}
    if not a.tiny:
        out["mfu_actor"] = 6 * n_actor * tokens / t["update_actor"] / G.PEAK_BF16_FLOPS
        out["mfu_forward_only"] = 2 * n_actor * tokens / t["forward_only"] / G.PEAK_BF16_FLOPS
        out["bwd_over_fwd"] = out["bwd_ms_sum"] / max(out["fwd_ms_sum"], 1e-9)
    return out
