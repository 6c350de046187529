"""Forward passes over a PPO batch: per-token log-probs, entropy and values.

Two layouts give the same numbers: padded rows (B, P+R), or every row's real tokens
packed into one row with position ids restarting per sequence (`use_sequence_packing`).
The hidden state at position t predicts token t+1, so the response tokens of a row with
prompt width P are predicted by positions P-1 .. P+R-2.

What keeps this fast on a GPU:
- packed rows run variable-length attention (`rlhf_varlen`, `rlhf.models.attention`:
  flash-attention over the sequences' `cu_seqlens`, no (T, T) mask, no attention across
  sequence borders);
- the LM head runs only on the positions that predict a response token, and log-probs
  and entropy come from `LinearLogProb`, which walks the vocabulary projection in row
  chunks and recomputes it in backward, so full-vocab float32 logits for a whole
  micro-batch never exist (the fused cross-entropy idea of Liger-Kernel and TRL);
- the critic's value head reads only the same positions.
Models whose parameters DeepSpeed ZeRO-3 partitions go through their own forward
(`logits_to_keep` still restricts the LM head to response positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as nnf

from rlhf.algos.logits import entropy_from_logits, logprobs_from_logits
from rlhf.models.attention import use_varlen_attention
from rlhf.trainer.batch import PPOBatch
from rlhf.data.batching import dynamic_micro_batches
from rlhf.trainer import dist as D

LOGPROB_CHUNK_ROWS = 2048  # rows of (rows, vocab) float32 logits alive at once in LinearLogProb


def micro_batches(batch: PPOBatch, micro_size: int, use_dynamic_bsz: bool, max_tokens: int) -> list[PPOBatch]:
    """Split a mini-batch into micro-batches: fixed row count, or a token budget per micro-batch.

    With a token budget every rank gets the same number of micro-batches (the largest any
    rank needs), because DeepSpeed ZeRO-2/3 reduce gradients in every backward: a rank with
    one micro-batch fewer would wait in a collective the others never enter."""
    groups = _groups(batch, micro_size, use_dynamic_bsz, max_tokens)
    if use_dynamic_bsz:
        groups = _same_count_across_ranks(groups, batch.seq_lengths(), batch.input_ids.device)
    return [batch.select(torch.as_tensor(g, dtype=torch.long, device=batch.input_ids.device)).trimmed()
            for g in groups]


def _same_count_across_ranks(groups: list[list[int]], lengths: list[int], device: torch.device) -> list[list[int]]:
    k = int(D.all_reduce_max(torch.tensor(float(len(groups)), device=device)).item())
    if k <= len(groups):
        return groups
    return balanced_split(lengths, min(k, len(lengths)))


def balanced_split(lengths: list[int], k: int) -> list[list[int]]:
    """Indices into `lengths` in k groups of near-equal token totals (longest first, each to the
    lightest group); every group non-empty when k <= len(lengths)."""
    import heapq

    heap = [(0, b) for b in range(k)]
    out: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        total, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (total + lengths[i], b))
    return [sorted(g) for g in out if g]


# ---------------------------------------------------------------------------------------------
# Layout: which hidden states predict the response tokens
# ---------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """Model inputs of one micro-batch and where its response-predicting positions are."""

    kwargs: dict  # input_ids / position_ids / attention_mask (+ cu_seqlens when packed)
    index: tuple  # indexes hidden (B', T, H) -> (N, H), N = response tokens of the micro-batch
    valid: torch.Tensor  # (b, R) bool, the response tokens
    labels: torch.Tensor  # (N,) the response tokens, in `index` order
    packed: bool


def layout(mb: PPOBatch, packed: bool) -> Layout:
    R = mb.responses.shape[1]
    valid = mb.response_mask.bool()  # (b, R)
    labels = mb.responses[valid]
    if not packed:
        P = mb.prompt_width
        rows, cols = valid.nonzero(as_tuple=True)
        kw = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
        return Layout(kw, (rows, cols + P - 1), valid, labels, False)
    real = mb.attention_mask.bool()  # (b, W); each row's real tokens are contiguous
    lens = real.sum(-1)  # (b,)
    p_len = mb.attention_mask[:, :mb.prompt_width].sum(-1)  # (b,)
    starts = torch.cumsum(lens, 0) - lens
    pos = (starts + p_len - 1)[:, None] + torch.arange(R, device=lens.device)[None]  # (b, R)
    lens_host = lens.tolist()
    cu = torch.tensor([0] + lens_host, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(lens.device)
    kw = dict(input_ids=mb.input_ids[real][None], position_ids=mb.position_ids[real][None],
              cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens_host), max_length_k=max(lens_host))
    return Layout(kw, (0, pos[valid]), valid, labels, True)


def _scatter(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(N,) values of the response tokens -> (b, R) float32, zero elsewhere."""
    out = torch.zeros(valid.shape, dtype=torch.float32, device=values.device)
    out[valid] = values.float()
    return out


def _model_kwargs(lay: Layout) -> dict:
    kw = dict(lay.kwargs)
    if lay.packed:
        kw.pop("attention_mask", None)
    return kw


# ---------------------------------------------------------------------------------------------
# Log-probs and entropy through the LM head, chunk by chunk
# ---------------------------------------------------------------------------------------------


class LinearLogProb(torch.autograd.Function):
    """log softmax(h W^T / T)[y] and the entropy of softmax(h W^T / T), per row.

    hidden (N, H), weight (V, H), labels (N,) -> (log_probs (N,), entropy (N,)) float32.
    Rows go `chunk` at a time; backward recomputes each chunk's logits, so memory holds
    one (chunk, V) float32 block instead of (N, V). Gradients, with p = softmax(x):
    d logp_y / dx = onehot(y) - p;  d H / dx = -p * (log p + H).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temp: float, chunk: int, with_entropy: bool):
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(lp)
        ent = torch.zeros_like(lp)
        for s in range(0, n, chunk):
            x = (hidden[s:s + chunk] @ weight.t()).float() * inv_temp  # (c, V)
            lse_c = torch.logsumexp(x, -1)
            lp[s:s + chunk] = x.gather(-1, labels[s:s + chunk, None]).squeeze(-1) - lse_c
            lse[s:s + chunk] = lse_c
            if with_entropy:
                p = torch.exp(x - lse_c[:, None])
                ent[s:s + chunk] = lse_c - (p * x).sum(-1)
        ctx.save_for_backward(hidden, weight, labels, lse, ent)
        ctx.inv_temp, ctx.chunk, ctx.with_entropy = inv_temp, chunk, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            x = (h @ weight.t()).float() * ctx.inv_temp  # (c, V)
            logp = x - lse[s:s + ctx.chunk, None]
            p = torch.exp(logp)
            gl = g_lp[s:s + ctx.chunk, None]
            if ctx.with_entropy:
                gx = p * (-gl - g_ent[s:s + ctx.chunk, None] * (logp + ent[s:s + ctx.chunk, None]))
            else:
                gx = p * -gl
            gx.scatter_add_(-1, labels[s:s + ctx.chunk, None], gl)
            gx = (gx * ctx.inv_temp).to(hidden.dtype)
            if need_h:
                grad_h[s:s + ctx.chunk] = gx @ weight
            if need_w:
                grad_w += (gx.t() @ h).float()
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     with_entropy: bool = False, chunk: int = LOGPROB_CHUNK_ROWS
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`LinearLogProb` with the temperature convention of the trainer (T <= 0 means 1)."""
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    return LinearLogProb.apply(hidden, weight, labels, inv_temp, max(1, chunk), with_entropy)


def _is_partitioned(*params: torch.Tensor) -> bool:
    """True for DeepSpeed ZeRO-3 parameters (their data lives in shards)."""
    return any(hasattr(p, "ds_id") for p in params)


def _fused_head(module: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The LM head when log-probs can be computed from hidden states as h W^T, else None."""
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or _is_partitioned(head.weight):
        return None
    cfg = module.config.get_text_config() if hasattr(module.config, "get_text_config") else module.config
    if any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                             "logits_scaling", "lm_head_multiplier")):
        return None
    return head


def log_probs(model: torch.nn.Module, mb: PPOBatch, temperature: float, packed: bool,
              with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens (b, R) under `model` at `temperature`, and entropy (b, R)."""
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    if packed:
        use_varlen_attention(module)
    lay = layout(mb, packed)
    head = _fused_head(module)
    if head is not None:
        hidden = module.base_model(**_model_kwargs(lay), use_cache=False).last_hidden_state  # (B', T, H)
        lp, ent = linear_log_probs(hidden[lay.index], head.weight, lay.labels, temperature, with_entropy)
    else:
        lp, ent = _log_probs_unfused(model, lay, temperature, with_entropy)
    return _scatter(lp, lay.valid), (_scatter(ent, lay.valid) if with_entropy else None)


def _log_probs_unfused(model, lay: Layout, temperature: float, with_entropy: bool):
    """Through the model's own forward (ZeRO-3, heads with a bias or logit scaling)."""
    rows, cols = lay.index if not lay.packed else (torch.zeros_like(lay.index[1]), lay.index[1])
    keep = torch.unique(cols)  # the LM head runs on these positions only
    logits = model(**_model_kwargs(lay), use_cache=False, logits_to_keep=keep).logits  # (B', K, V)
    x = logits[rows, torch.searchsorted(keep, cols)]  # (N, V)
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    lp = logprobs_from_logits(x, lay.labels, chunk_size=LOGPROB_CHUNK_ROWS)
    ent = entropy_from_logits(x, chunk_size=LOGPROB_CHUNK_ROWS) if with_entropy else None
    return lp, ent


def values(critic: torch.nn.Module, mb: PPOBatch, packed: bool) -> torch.Tensor:
    """Critic values V(s_t) of the state before each response token, (b, R) float32."""
    module = getattr(critic, "module", critic)
    backbone, head = getattr(module, "backbone", None), getattr(module, "value_head", None)
    lay = layout(mb, packed)
    if backbone is None or head is None:
        kw = _model_kwargs(lay)
        if packed:  # a critic's own forward takes no attention kwargs beyond these
            kw = {k: kw[k] for k in ("input_ids", "position_ids")}
            use_varlen_attention(module)
        return _scatter(critic(**kw)[lay.index], lay.valid)
    if packed:
        use_varlen_attention(backbone)
    hidden = backbone(**_model_kwargs(lay), use_cache=False).last_hidden_state[lay.index]  # (N, H)
    if _is_partitioned(head.weight):  # ZeRO-3 gathers the head's weight around its own call
        v = head(hidden.to(head.weight.dtype)).float()
    else:  # the head in float32 whatever dtype the engine cast it to
        v = nnf.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float())
    return _scatter(v.squeeze(-1), lay.valid)


@torch.no_grad()
def batched_log_probs(model, batch: PPOBatch, micro: int, temperature: float, packed: bool,
                      dynamic: bool = False, max_tokens: int = 0) -> torch.Tensor:
    """Log-probs (B, R) over a whole batch, computed micro-batch by micro-batch without grad."""
    out = torch.zeros_like(batch.response_mask)
    for idx, mb in _indexed(batch, micro, dynamic, max_tokens):
        lp, _ = log_probs(model, mb, temperature, packed)
        out[idx.to(out.device), :lp.shape[1]] = lp.to(out.dtype)
    return out


@torch.no_grad()
def batched_values(critic, batch: PPOBatch, micro: int, packed: bool, dynamic: bool = False,
                   max_tokens: int = 0) -> torch.Tensor:
    out = torch.zeros_like(batch.response_mask)
    for idx, mb in _indexed(batch, micro, dynamic, max_tokens):
        v = values(critic, mb, packed)
        out[idx.to(out.device), :v.shape[1]] = v.to(out.dtype)
    return out


def _groups(batch: PPOBatch, micro: int, dynamic: bool, max_tokens: int) -> list[list[int]]:
    if dynamic:
        return [g for g in dynamic_micro_batches(batch.seq_lengths(), max_tokens) if g]
    return [list(range(i, min(i + micro, len(batch)))) for i in range(0, len(batch), micro)]


def _indexed(batch: PPOBatch, micro: int, dynamic: bool, max_tokens: int) -> Iterator[tuple[torch.Tensor, PPOBatch]]:
    for g in _groups(batch, micro, dynamic, max_tokens):
        if g:
            idx = torch.as_tensor(g, dtype=torch.long)
            yield idx, batch.select(idx.to(batch.input_ids.device)).trimmed()
