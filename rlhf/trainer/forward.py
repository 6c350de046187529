"""Forward passes over a PPO batch: per-token log-probs, entropy and values.

Two layouts give the same numbers: padded rows (B, P+R), or every row's real tokens
packed into one row with position ids restarting per sequence (`use_sequence_packing`).
The logit at position t predicts token t+1, so the response tokens of a row with
prompt width P are predicted by positions P-1 .. P+R-2.
"""

from __future__ import annotations

from typing import Iterator

import torch

from rlhf import algos
from rlhf.trainer.batch import PPOBatch


def micro_batches(batch: PPOBatch, micro_size: int, use_dynamic_bsz: bool, max_tokens: int) -> list[PPOBatch]:
    """Split a mini-batch into micro-batches: fixed row count, or a token budget per micro-batch."""
    if use_dynamic_bsz:
        from rlhf.data.batching import dynamic_micro_batches

        groups = dynamic_micro_batches(batch.seq_lengths(), max_tokens)
    else:
        groups = [list(range(i, min(i + micro_size, len(batch)))) for i in range(0, len(batch), micro_size)]
    return [batch.select(g).trimmed() for g in groups if g]


def _logits_padded(model: torch.nn.Module, mb: PPOBatch) -> torch.Tensor:
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                use_cache=False)
    R = mb.responses.shape[1]
    return out.logits[:, -R - 1:-1]  # (b, R, V)


def _packed_inputs(mb: PPOBatch) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """(1, T) ids and position ids of all real tokens, and per row (start, prompt_len, resp_len)."""
    P = mb.prompt_width
    ids, pos, spans, start = [], [], [], 0
    for i in range(len(mb)):
        keep = mb.attention_mask[i].bool()
        row = mb.input_ids[i][keep]
        p_len = int(mb.attention_mask[i, :P].sum())
        r_len = int(mb.response_mask[i].sum())
        ids.append(row)
        pos.append(torch.arange(row.numel(), device=row.device))
        spans.append((start, p_len, r_len))
        start += row.numel()
    return torch.cat(ids)[None], torch.cat(pos)[None], spans


def _gather_packed(per_token: torch.Tensor, spans: list[tuple[int, int, int]], R: int) -> torch.Tensor:
    """(1, T, ...) packed outputs -> (b, R, ...) aligned with the response tokens, zero-padded."""
    rows = []
    for start, p_len, r_len in spans:
        seg = per_token[0, start + p_len - 1:start + p_len - 1 + r_len]
        pad = per_token.new_zeros((R - r_len,) + tuple(per_token.shape[2:]))
        rows.append(torch.cat([seg, pad]))
    return torch.stack(rows)


def _logits_packed(model: torch.nn.Module, mb: PPOBatch) -> torch.Tensor:
    ids, pos, spans = _packed_inputs(mb)
    # use_cache=False: with a KV cache, transformers ignores restarting position ids.
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits  # (1, T, V)
    return _gather_packed(logits, spans, mb.responses.shape[1])


def log_probs(model: torch.nn.Module, mb: PPOBatch, temperature: float, packed: bool,
              with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens (b, R) under `model` at `temperature`, and entropy (b, R)."""
    logits = (_logits_packed if packed else _logits_padded)(model, mb).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    lp = algos.logprobs_from_logits(logits, mb.responses)
    ent = algos.entropy_from_logits(logits) if with_entropy else None
    return lp * mb.response_mask, (ent * mb.response_mask if ent is not None else None)


def values(critic: torch.nn.Module, mb: PPOBatch, packed: bool) -> torch.Tensor:
    """Critic values V(s_t) of the state before each response token, (b, R)."""
    R = mb.responses.shape[1]
    if packed:
        ids, pos, spans = _packed_inputs(mb)
        v = critic(input_ids=ids, position_ids=pos)  # (1, T)
        out = _gather_packed(v[..., None], spans, R)[..., 0]
    else:
        v = critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
        out = v[:, -R - 1:-1]
    return out.float() * mb.response_mask


@torch.no_grad()
def batched_log_probs(model, batch: PPOBatch, micro: int, temperature: float, packed: bool,
                      dynamic: bool = False, max_tokens: int = 0) -> torch.Tensor:
    """Log-probs (B, R) over a whole batch, computed micro-batch by micro-batch without grad."""
    out = torch.zeros_like(batch.response_mask)
    for idx, mb in _indexed(batch, micro, dynamic, max_tokens):
        lp, _ = log_probs(model, mb, temperature, packed)
        out[idx, :lp.shape[1]] = lp.to(out.dtype)
    return out


@torch.no_grad()
def batched_values(critic, batch: PPOBatch, micro: int, packed: bool, dynamic: bool = False,
                   max_tokens: int = 0) -> torch.Tensor:
    out = torch.zeros_like(batch.response_mask)
    for idx, mb in _indexed(batch, micro, dynamic, max_tokens):
        v = values(critic, mb, packed)
        out[idx, :v.shape[1]] = v.to(out.dtype)
    return out


def _indexed(batch: PPOBatch, micro: int, dynamic: bool, max_tokens: int) -> Iterator[tuple[torch.Tensor, PPOBatch]]:
    if dynamic:
        from rlhf.data.batching import dynamic_micro_batches

        groups = dynamic_micro_batches(batch.seq_lengths(), max_tokens)
    else:
        groups = [list(range(i, min(i + micro, len(batch)))) for i in range(0, len(batch), micro)]
    for g in groups:
        if g:
            idx = torch.as_tensor(g, dtype=torch.long)
            yield idx, batch.select(idx).trimmed()
