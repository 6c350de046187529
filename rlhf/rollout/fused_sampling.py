"""Sampling a token per row of (rows, vocab) logits in one pass over the logits.

`sample_next` in `rlhf.rollout.hf` makes about ten passes over a float32 copy of the logits
(convert, scale, log-softmax, softmax, multinomial's checks, noise and argmax): at 1024 rows
of a 152k vocabulary that is ~10 GB of memory traffic per decode step, as much as the
step's weights and keys together. `fused_sample` reads the bf16 logits once per row and
keeps a running log-sum-exp and a running Gumbel-max (ties go to the lowest index, as in
`argmax`):

    token   = argmax_j (x_j + g_j),  x = logits / T,  g_j = -log(-log u_j),  u_j ~ U[0, 1)
    logprob = x_token - logsumexp(x)

which draws from softmax(x) exactly (the Gumbel-max identity) and returns the same log-prob
`sample_next` returns. T = 0 is greedy (argmax of the logits, log-prob of the unscaled
logits). Top-k / top-p filtering is not fused: `fused_applies` says when the kernel can be
used. The noise comes from Philox keyed by a per-step seed drawn from the caller's
generator on the device, so a seeded rollout repeats exactly and nothing waits on the host.
"""

from __future__ import annotations

import torch

from rlhf.rollout.triton_support import tl, triton

BLOCK = 4096  # vocabulary entries per iteration of one row's loop


def fused_applies(top_k: int, top_p: float, vocab: int) -> bool:
    """No filtering is asked for (top-k off or >= vocab, top-p 1)."""
    return (top_k <= 0 or top_k >= vocab) and top_p >= 1.0


if triton is not None:

    @triton.jit
    def _sample_rows(logits_ptr, stride, vocab, inv_t, seed_ptr, tok_ptr, lp_ptr,
                     GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        seed = tl.load(seed_ptr) + row
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max of x
        s = tl.zeros([BLOCK], tl.float32)  # per-lane sum of exp(x - m)
        best = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane best x + noise
        best_x = tl.zeros([BLOCK], tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + lanes
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, x)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_ref) + tl.exp(x - m_ref)
            m = m_new
            if GREEDY:
                score = x
            else:  # one Philox call gives 4 uniforms: BLOCK / 4 calls per tile
                r0, r1, r2, r3 = tl.rand4x(seed, start // 4 + tl.arange(0, BLOCK // 4))
                u = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK])
                score = x - tl.log(-tl.log(u))
            take = score > best
            best = tl.where(take, score, best)
            best_x = tl.where(take, x, best_x)
            best_i = tl.where(take, idx, best_i)
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
        top_score = tl.max(best, 0)
        tok = tl.min(tl.where(best == top_score, best_i, vocab), 0)  # ties: the lowest index, as argmax
        x_tok = tl.max(tl.where((best == top_score) & (best_i == tok), best_x, float("-inf")), 0)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, x_tok - lse)


def fused_sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logprobs (B,) float32) from logits (B, V), one pass per row."""
    if triton is None:
        raise RuntimeError("fused_sample needs Triton; use rlhf.rollout.hf.sample_next")
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"fused_sample wants (rows, vocab) logits contiguous in the vocab, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    dev = logits.device
    greedy = temperature == 0
    seed = torch.randint(0, 2**30, (1,), device=dev, generator=generator, dtype=torch.int32) if not greedy \
        else torch.zeros(1, device=dev, dtype=torch.int32)
    tokens = torch.empty(rows, device=dev, dtype=torch.int64)
    logprobs = torch.empty(rows, device=dev, dtype=torch.float32)
    inv_t = 1.0 if greedy else 1.0 / temperature
    _sample_rows[(rows,)](logits, logits.stride(0), vocab, inv_t, seed, tokens, logprobs, GREEDY=greedy,
                          BLOCK=BLOCK, num_warps=8)
    return tokens, logprobs
