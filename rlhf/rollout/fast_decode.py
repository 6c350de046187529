"""A fast rollout engine for transformers causal LMs: static KV cache, packed prefill,
CUDA-graph decode.

Same protocol and sampling rules as `HFRolloutEngine` (temperature / top-k / top-p,
`n` responses per prompt, EOS or `max_tokens`, log-probs of `log_softmax(logits / T)`),
with the decode loop rebuilt around what a GPU needs:

- one static KV buffer per layer, (rows x max_len, kv_heads, head_dim); row r's token at
  position j lives at slot r * max_len + j, so nothing is concatenated or reallocated;
- prefill packs each distinct prompt once (padding-free, variable-length attention) and
  copies its keys and values into the rows of its `n` responses, so a prompt costs one
  forward however many samples it gets;
- a decode step attends to each row's own length only (flash-attention's `seqused_k`;
  SDPA with a length mask where flash is unavailable); the query heads that share a KV
  head run as one block of queries, so each key is read once per KV head;
- the step is replayed from a CUDA graph, so the ~20 kernels per layer launch as one graph;
- RMSNorm, the SiLU gate and the rotary embedding run as one Triton kernel each
  (`fused_ops.py`), the decode attention as one Triton kernel per layer
  (`decode_attention.py`);
- sampling stays outside the graph and reads the logits once (`fused_sampling.py`).

The model's own modules run the forward: an attention function registered as
`rlhf_static_kv` reads and writes the buffers of the step in progress. A module shared
with a trainer is switched back to its previous attention when `generate` returns.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as nnf

from rlhf.models.attention import flash_attention_varlen, varlen_flash, varlen_reference
from rlhf.rollout.base import RolloutBatch, SamplingParams
from rlhf.rollout.decode_attention import triton_decode
from rlhf.rollout.fused_ops import fused_decode_ops
from rlhf.rollout.fused_sampling import fused_applies, fused_sample
from rlhf.rollout.hf import HFRolloutEngine, check_params, cut_at_stop, resolve_device, sample_next
from rlhf.rollout.triton_support import triton_available

STATIC_KV_ATTENTION = "rlhf_static_kv"
PREFILL_TOKENS = 65536  # packed prompt tokens per prefill forward
_STEP = threading.local()  # the step in progress, read by the attention function


@dataclass
class _Step:
    """What the attention function of every layer needs for the forward in progress."""

    keys: list[torch.Tensor]  # per layer (rows * L, kv_heads, D)
    values: list[torch.Tensor]
    rows: int
    max_len: int  # L, positions per row
    prefill: bool
    dests: Optional[list[torch.Tensor]] = None  # prefill: flat slots of each packed token, one per copy
    cu_q: Optional[torch.Tensor] = None  # prefill: (P+1,) int32 over packed prompts; decode: arange(rows+1)
    cu_k: Optional[torch.Tensor] = None  # decode: (rows+1,) int32, row starts in the flat buffer
    max_q: int = 1
    write: Optional[torch.Tensor] = None  # decode: (rows,) flat slot of the new token
    used: Optional[torch.Tensor] = None  # decode: (rows,) int32 keys per row, the new one included
    kv_window: int = 0  # decode on SDPA: attend to the first kv_window positions only
    flash: bool = True
    triton: bool = False  # decode: the Triton kernel of `decode_attention.py`
    group: bool = True  # decode on flash: a KV head's query heads as one block of queries
    cu_group: Optional[torch.Tensor] = None  # decode, grouped: (rows+1,) int32, arange(rows+1) * G


def static_kv_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: float | None = None, **kwargs):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) -> ((B, T, Hq, D), None)."""
    step: _Step = _STEP.current
    layer = module.layer_idx
    kc, vc = step.keys[layer], step.values[layer]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if step.prefill:
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
        for dest in step.dests:
            kc.index_copy_(0, dest, k)
            vc.index_copy_(0, dest, v)
        if q.is_cuda and step.flash:
            out = varlen_flash(q, k, v, step.cu_q, step.max_q, scale)
        else:
            out = varlen_reference(q, k, v, step.cu_q.tolist(), scale)
        return out[None], None
    q = query[:, :, 0]  # (B, Hq, D)
    kc.index_copy_(0, step.write, key[:, :, 0])
    vc.index_copy_(0, step.write, value[:, :, 0])
    if step.triton:
        out = triton_decode(q, kc, vc, step.used, step.max_len, scale)
    elif q.is_cuda and step.flash:
        out = _decode_flash(q, kc, vc, step, scale)
    else:
        out = _decode_sdpa(q, kc, vc, step, scale)
    return out[:, None], None


def group_queries(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, Hq, D) -> (B * G, Hkv, D) with G = Hq / Hkv: the G query heads that share a KV
    head become G query positions of that head (query head h reads KV head h // G, as
    transformers' `repeat_kv` lays them out)."""
    B, Hq, D = q.shape
    return q.view(B, hkv, Hq // hkv, D).transpose(1, 2).reshape(B * (Hq // hkv), hkv, D)


def ungroup_queries(out: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of `group_queries`: (B * G, Hkv, D) -> (B, Hkv * G, D)."""
    g = out.shape[0] // rows
    return out.view(rows, g, out.shape[1], out.shape[2]).transpose(1, 2).reshape(rows, -1, out.shape[2])


def _decode_flash(q, kc, vc, step: _Step, scale: float) -> torch.Tensor:
    """One query per row against its first `used` keys with flash-attention's varlen kernel:
    (B, Hq, D) -> (B, Hq, D). With `step.group` (grouped-query models) the query heads
    of a KV head run as one block of G non-causal queries, so each key and value is read
    once per KV head instead of once per query head."""
    if not step.group or q.shape[1] == kc.shape[1]:
        return _flash_varlen(q, kc, vc, step.cu_q, step.cu_k, 1, step.max_len, scale, step.used)
    rows, hkv = q.shape[0], kc.shape[1]
    g = q.shape[1] // hkv
    cu_group = step.cu_group if step.cu_group is not None else step.cu_q * g
    out = _flash_varlen(group_queries(q, hkv), kc, vc, cu_group, step.cu_k, g, step.max_len, scale, step.used)
    return ungroup_queries(out, rows)


def _flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, used) -> torch.Tensor:
    """Non-causal variable-length flash attention: sequence i's queries cu_q[i]:cu_q[i+1]
    attend to keys cu_k[i]:cu_k[i] + used[i]; query head h reads KV head h // (Hq / Hkv)."""
    return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=False, seqused_k=used)


def _decode_sdpa(q, kc, vc, step: _Step, scale: float) -> torch.Tensor:
    """One query per row against its first `used` keys: (B, Hq, D) -> (B, Hq, D).

    Query heads are grouped under their KV head so that SDPA sees plain multi-head
    attention with G queries per head and no repeated keys."""
    B, Hq, D = q.shape
    W = step.kv_window or step.max_len
    k = kc.view(B, step.max_len, -1, D)[:, :W].transpose(1, 2)  # (B, Hkv, W, D)
    v = vc.view(B, step.max_len, -1, D)[:, :W].transpose(1, 2)
    hkv = k.shape[1]
    mask = (torch.arange(W, device=q.device)[None] < step.used[:, None])[:, None, None]  # (B, 1, 1, W)
    out = nnf.scaled_dot_product_attention(q.view(B, hkv, Hq // hkv, D), k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, Hq, D)


def register_static_kv_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(STATIC_KV_ATTENTION, static_kv_attention)


def flash_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.backends.cuda.is_flash_attention_available()


class FastHFRolloutEngine(HFRolloutEngine):
    """`RolloutEngine` over a transformers causal LM held in this process (one GPU, or CPU
    without graphs for testing). `batch_size` counts sequences (prompts x n) decoded together.

    `decode_attention`: "auto" (on a GPU: triton where Triton is installed, else flash where
    available; SDPA on a CPU), "flash", "sdpa" or "triton" (`decode_attention.py`: each row's
    keys read once per KV head in one kernel). Prefill uses flash's varlen kernel where it
    can, except with "sdpa".
    `cuda_graphs`: replay each decode step from a captured graph (GPU only).
    `group_decode_queries`: on flash, run the query heads that share a KV head as one block
    of queries (reads each key once per KV head, not once per query head).
    `fused_sampling`: draw tokens with the one-pass Triton sampler (`fused_sampling.py`) where
    it applies (CUDA with Triton, no top-k / top-p filtering); else `sample_next`.
    `fused_ops`: on CUDA with Triton, run RMSNorm, the SiLU gate and the rotary embedding of
    the decode steps as one kernel each (`fused_ops.py`).
    """

    def __init__(self, model, tokenizer, batch_size: int = 1024, device: str | torch.device | None = None,
                 seed: int = 0, cuda_graphs: bool = True, decode_attention: str = "auto", kv_window_step: int = 128,
                 group_decode_queries: bool = True, fused_sampling: bool = True, fused_ops: bool = True):
        if batch_size < 1:
            raise ValueError(f"FastHFRolloutEngine batch_size must be >= 1, got {batch_size}")
        if tokenizer.eos_token_id is None:
            raise ValueError("FastHFRolloutEngine needs a tokenizer with an eos_token")
        if decode_attention not in ("auto", "flash", "sdpa", "triton"):
            raise ValueError(f"decode_attention must be auto, flash, sdpa or triton, got {decode_attention!r}")
        self.device = resolve_device(device, model)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        if decode_attention == "auto":  # measured on an H200: triton 3.6 ms, flash 7.0 ms, SDPA 9.2 ms per step
            decode_attention = "triton" if self.device.type == "cuda" and triton_available(self.device) \
                else "flash" if flash_available(self.device) else "sdpa"
        self.decode_attention = decode_attention
        self.flash = decode_attention == "flash"
        self.triton = decode_attention == "triton"
        if self.triton and not triton_available(self.device):
            raise ValueError("decode_attention='triton' needs Triton and a CUDA device")
        self.prefill_flash = decode_attention != "sdpa" and flash_available(self.device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.kv_window_step = kv_window_step
        self.group_decode_queries = group_decode_queries
        self.fused_sampling = fused_sampling
        self.fused_ops = fused_ops
        self.stats: dict[str, float] = {}
        self.model = None
        self.set_model(model)

    # -- the protocol (set_model, update_weights, close: HFRolloutEngine's) -------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        check_params(prompts, params)
        register_static_kv_attention()
        was_training, previous = self.model.training, self.model.config._attn_implementation
        self.model.eval()
        self.model.set_attn_implementation(STATIC_KV_ATTENTION)
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        fused = fused_decode_ops(self.model) if self.fused_ops and triton_available(self.device) \
            else contextlib.nullcontext()
        try:
            with torch.no_grad(), fused:
                results = self._generate(prompts, params, generator)
        finally:
            self.model.set_attn_implementation(previous)
            self.model.train(was_training)
        owner = [i for i in range(len(prompts)) for _ in range(params.n)]
        return RolloutBatch(
            prompt_ids=[list(prompts[i]) for i in owner],
            response_ids=[r[0] for r in results],
            response_text=self.tokenizer.batch_decode([r[0] for r in results], skip_special_tokens=True),
            logprobs=[r[1] for r in results], finish_reason=[r[2] for r in results],
            group_ids=list(owner), prompt_index=list(owner))

    # -- batches -------------------------------------------------------------------------------
    def _generate(self, prompts, params: SamplingParams, generator):
        per_batch = max(1, self.batch_size // params.n)  # prompts per batch; a prompt's n rows stay together
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: list = [None] * (len(prompts) * params.n)
        for b in range(0, len(order), per_batch):
            idx = order[b:b + per_batch]
            for k, res in enumerate(self._decode([prompts[i] for i in idx], params, generator)):
                results[idx[k // params.n] * params.n + k % params.n] = res
        return results

    def _buffers(self, rows: int, max_len: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        cfg = self.model.config.get_text_config()
        hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        shape = (rows * max_len, hkv, d)
        keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        return keys, values

    def _decode(self, prompts: list[list[int]], params: SamplingParams, generator):
        """Prefill the batch's prompts, then decode `n` rows per prompt until stop or `max_tokens`."""
        import time

        n, dev = params.n, self.device
        rows = len(prompts) * n
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        longest = max(len(p) for p in prompts)
        max_len = longest + params.max_tokens
        keys, values = self._buffers(rows, max_len)
        t0 = time.perf_counter()
        logits = self._prefill(prompts, keys, values, max_len, n)  # (P, V) last-prompt-token logits
        row_len = lens.repeat_interleave(n)  # (rows,) tokens held per row
        step = self._decode_step(keys, values, max_len, row_len)
        tok_in = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        pos_in = row_len[:, None].clone()  # position of the token being fed
        logits = logits.repeat_interleave(n, 0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        done = torch.zeros(rows, dtype=torch.bool, device=dev)
        stop = torch.tensor(self.stop_ids, device=dev)
        tokens, logprobs = [], []
        graphs: dict[int, tuple] = {}
        fused = self.fused_sampling and triton_available(dev) and fused_applies(params.top_k, params.top_p,
                                                                                 logits.shape[-1])
        for t in range(params.max_tokens):
            if fused:
                tok, lp = fused_sample(logits, params.temperature, generator)
            else:
                tok, lp = sample_next(logits, params, generator)
            tok = tok.masked_fill(done, self.pad_id)
            tokens.append(tok)
            logprobs.append(lp)
            done |= torch.isin(tok, stop)
            if t == params.max_tokens - 1 or (t % 16 == 15 and bool(done.all())):
                break
            tok_in.copy_(tok[:, None])
            step.kv_window = 0 if self.flash or self.triton else min(max_len, _round_up(longest + t + 1,
                                                                                      self.kv_window_step))
            logits = self._step(step, tok_in, pos_in, graphs)
            pos_in += 1
            step.write += 1
            step.used += 1
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        self.stats = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "steps": len(tokens), "rows": rows,
                      "max_len": max_len, "graphs": len(graphs), "fused_sampling": fused}
        lps = torch.stack(logprobs, 1)
        if fused and not bool(torch.isfinite(lps).all()):  # sample_next raises on such logits itself
            raise FloatingPointError("the policy's logits were NaN or inf while sampling: the rollout's log-probs "
                                     "are not finite (check the weights the engine was given)")
        out = cut_at_stop(torch.stack(tokens, 1).tolist(), lps.tolist(), self.stop_ids)
        del keys, values, graphs
        return out

    def _decode_step(self, keys, values, max_len: int, row_len: torch.Tensor) -> _Step:
        """The decode `_Step` of rows holding `row_len` (rows,) tokens each: the first token
        fed is written at slot `row_len` of its row and attends to `row_len + 1` keys."""
        dev, rows = self.device, row_len.shape[0]
        cfg = self.model.config.get_text_config()
        group = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        return _Step(keys, values, rows, max_len, prefill=False, flash=self.flash, triton=self.triton,
                     group=self.group_decode_queries,
                     cu_group=torch.arange(rows + 1, dtype=torch.int32, device=dev) * group,
                     cu_q=torch.arange(rows + 1, dtype=torch.int32, device=dev),
                     cu_k=(torch.arange(rows + 1, device=dev) * max_len).to(torch.int32),
                     write=torch.arange(rows, device=dev) * max_len + row_len, used=(row_len + 1).to(torch.int32))

    def _prefill(self, prompts, keys, values, max_len: int, n: int) -> torch.Tensor:
        """Packed forward over the distinct prompts, chunked by PREFILL_TOKENS; K/V copied
        into each prompt's n rows. Returns the logits of every prompt's last token (P, V)."""
        dev, out = self.device, []
        start = 0
        while start < len(prompts):
            end, total = start, 0
            while end < len(prompts) and (end == start or total + len(prompts[end]) <= PREFILL_TOKENS):
                total += len(prompts[end])
                end += 1
            chunk = prompts[start:end]
            lens = torch.tensor([len(p) for p in chunk], device=dev)
            cu = torch.zeros(len(chunk) + 1, dtype=torch.int32, device=dev)
            cu[1:] = torch.cumsum(lens, 0)
            ids = torch.tensor([t for p in chunk for t in p], device=dev)[None]
            pos = torch.cat([torch.arange(len(p), device=dev) for p in chunk])[None]
            first_row = (torch.arange(start, end, device=dev) * n).repeat_interleave(lens)  # (T,)
            dests = [(first_row + c) * max_len + pos[0] for c in range(n)]
            _STEP.current = _Step(keys, values, 0, max_len, prefill=True, dests=dests, cu_q=cu,
                                  max_q=max(len(p) for p in chunk), flash=self.prefill_flash)
            try:
                o = self.model(input_ids=ids, position_ids=pos, use_cache=False,
                               logits_to_keep=(cu[1:] - 1).long())
            finally:
                _STEP.current = None
            out.append(o.logits[0])
            start = end
        return torch.cat(out)

    def _step(self, step: _Step, tok_in: torch.Tensor, pos_in: torch.Tensor, graphs: dict) -> torch.Tensor:
        """Logits (rows, V) of one decode step: a replayed CUDA graph, or eager."""
        if not self.cuda_graphs:
            return self._forward(step, tok_in, pos_in)
        key = step.kv_window
        if key not in graphs:
            graphs[key] = self._capture(step, tok_in, pos_in)
        graph, out = graphs[key]
        graph.replay()
        return out

    def _forward(self, step: _Step, tok_in, pos_in) -> torch.Tensor:
        _STEP.current = step
        try:
            return self.model(input_ids=tok_in, position_ids=pos_in, use_cache=False).logits[:, -1]
        finally:
            _STEP.current = None

    def _capture(self, step: _Step, tok_in, pos_in):
        """Capture one decode step; the graph reads `tok_in`, `pos_in` and the step's index
        tensors, which the loop updates in place. The warm-up runs write the KV slot of the
        current step only, which the replay then writes again with the same values."""
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):
                self._forward(step, tok_in, pos_in)
        torch.cuda.current_stream(self.device).wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the checkpoint writer's thread copies state off the GPU on its own stream
        # while rounds go on; a global-mode capture would make those calls (and the capture) fail.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = self._forward(step, tok_in, pos_in)
        return graph, out


def _round_up(x: int, step: int) -> int:
    return -(-x // step) * step
