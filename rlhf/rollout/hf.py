"""Rollout with a plain transformers model and a decode loop of our own.

Sequences (each prompt repeated `n` times) are sorted by prompt length, cut into
batches of `batch_size` sequences, left-padded, prefilled once, then decoded one token
per step with the KV cache until every sequence has hit EOS (the tokenizer's, or one
listed in the model's generation config) or `max_tokens`.

Log-probs: for each sampled token we record `log_softmax(logits / T)` over the full
vocabulary, i.e. under the temperature-scaled distribution before top-k/top-p
truncation. That is the quantity the trainer recomputes (verl divides the logits by
the rollout temperature), so with top-k/top-p off the rollout/trainer mismatch is
numerical noise only; vLLM's `logprobs_mode="processed_logprobs"` equals it when
top-k/top-p are off. Greedy decoding (T = 0) records `log_softmax(logits)`.
"""

from __future__ import annotations

import torch

from rlhf.rollout.base import RolloutBatch, SamplingParams
from rlhf.models.load import load_weights_into


def resolve_device(device: str | torch.device | None, model: torch.nn.Module) -> torch.device:
    if device is None:
        return next(model.parameters()).device
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (B, P), attention_mask (B, P)) with padding on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def plan_batches(lengths: list[int], batch_size: int, sort_by_length: bool = True) -> list[list[int]]:
    """Indices into `lengths`, cut into batches; longest prompts first when sorting (stable)."""
    order = list(range(len(lengths)))
    if sort_by_length:
        order.sort(key=lambda i: -lengths[i])
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf; at least one token is kept.

    logits: (B, V), already divided by the temperature.
    """
    if 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # probability of the tokens ranked above
        drop_sorted = mass_before >= top_p  # the top token always has mass_before = 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,), logprobs (B,)) from last-position logits (B, V)."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        logprobs = torch.log_softmax(logits, -1)
    else:
        scaled = logits / params.temperature
        logprobs = torch.log_softmax(scaled, -1)
        probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), -1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def check_params(prompts: list[list[int]], params: SamplingParams) -> None:
    if params.n < 1 or params.max_tokens < 1:
        raise ValueError(f"SamplingParams n ({params.n}) and max_tokens ({params.max_tokens}) must be >= 1")
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature must be >= 0 (0 => greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts {empty[:5]} are empty; every prompt needs at least one token (e.g. BOS)")


class HFRolloutEngine:
    """`RolloutEngine` over a transformers causal LM held in this process.

    `batch_size` counts sequences (prompts x n) per decode batch. Sampling is seeded by
    `SamplingParams.seed` when given, else by this engine's generator (seeded by `seed`).
    """

    def __init__(self, model, tokenizer, batch_size: int = 256, device: str | torch.device | None = None,
                 seed: int = 0, sort_by_length: bool = True):
        if batch_size < 1:
            raise ValueError(f"HFRolloutEngine batch_size must be >= 1, got {batch_size}")
        if tokenizer.eos_token_id is None:
            raise ValueError("HFRolloutEngine needs a tokenizer with an eos_token")
        self.device = resolve_device(device, model)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.sort_by_length = sort_by_length
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.stop_ids: list[int] = []
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.model = None
        self.set_model(model)

    def set_model(self, model) -> None:
        """Generate with `model` from now on (moved to this engine's device).

        The module may be shared with a trainer: `generate` switches it to eval mode and
        restores its train/eval mode afterwards.
        """
        self.model = model.to(self.device)
        self.stop_ids = stop_token_ids(self.model, self.eos_id)

    def update_weights(self, model_dir: str) -> None:
        """Copy the safetensors weights of `model_dir` into the held model."""
        load_weights_into(self.model, model_dir)

    def release(self) -> None:
        """Nothing to give back: the model is the trainer's."""

    def close(self) -> None:
        self.model = None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        check_params(prompts, params)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():  # not inference_mode: the module may be trained afterwards
                return self._generate(prompts, params)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        owner = [i for i in range(len(prompts)) for _ in range(params.n)]  # sequence -> prompt index
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        results: list[tuple[list[int], list[float], str]] = [([], [], "")] * len(owner)
        for idx in plan_batches([len(prompts[i]) for i in owner], self.batch_size, self.sort_by_length):
            for j, res in zip(idx, self._decode([prompts[owner[j]] for j in idx], params, generator)):
                results[j] = res
        return RolloutBatch(
            prompt_ids=[list(prompts[i]) for i in owner],
            response_ids=[r[0] for r in results],
            response_text=self.tokenizer.batch_decode([r[0] for r in results], skip_special_tokens=True),
            logprobs=[r[1] for r in results],
            finish_reason=[r[2] for r in results],
            group_ids=list(owner),
            prompt_index=list(owner),
        )

    def _decode(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator
                ) -> list[tuple[list[int], list[float], str]]:
        """Prefill once, then one token per step with the KV cache; (tokens, logprobs, finish) per row."""
        from transformers import DynamicCache

        ids, mask = left_pad(prompts, self.pad_id, self.device)  # (B, P)
        position = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P): positions count real tokens only
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        next_pos = position[:, -1:] + 1  # (B, 1)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        stop = torch.tensor(self.stop_ids, device=self.device)
        tokens, logprobs = [], []
        for step in range(params.max_tokens):
            tok, lp = sample_next(out.logits[:, -1], params, generator)
            tok = tok.masked_fill(done, self.pad_id)
            tokens.append(tok)
            logprobs.append(lp)
            done |= torch.isin(tok, stop)
            if bool(done.all()) or step == params.max_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                             past_key_values=out.past_key_values, use_cache=True)
            next_pos = next_pos + 1
        return cut_at_stop(torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).tolist(), self.stop_ids)


def stop_token_ids(model, eos_id: int) -> list[int]:
    """The tokenizer's EOS plus any the model's generation config lists (e.g. an end-of-turn token)."""
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return sorted({eos_id, *extra})


def cut_at_stop(tokens: list[list[int]], logprobs: list[list[float]], stop_ids: list[int]
                ) -> list[tuple[list[int], list[float], str]]:
    """Cut each row after its first stop token (kept): "stop"; rows without one ran out of tokens: "length"."""
    rows = []
    stop = set(stop_ids)
    for toks, lps in zip(tokens, logprobs):
        end = next((i + 1 for i, t in enumerate(toks) if t in stop), None)
        rows.append((toks[:end], lps[:end], "stop") if end else (toks, lps, "length"))
    return rows
