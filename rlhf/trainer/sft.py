"""Supervised warm-start: next-token loss on the response tokens only.

Each example is `prompt_ids + response_ids + [eos]`; the labels are -100 on the prompt,
so only the response and its closing EOS are learned (the policy must learn to stop).
AdamW with linear warmup, then constant or cosine decay to `min_lr_ratio * lr`.
The run ends at whichever comes first: `max_steps`, `epochs`, `max_seconds`, or greedy
accuracy on a probe of the training problems reaching `stop_at_accuracy` (a warm-start
that leaves room for RL). It runs on `num_threads` CPU threads: the result depends on
the thread count (summation order), and one thread is steadier on a small shared CPU.

Mixed precision: pass `autocast_dtype` (e.g. "bfloat16"); each step's forward and loss then
run in their own `torch.autocast` region, and the fp32 weights stay the optimizer's. A
caller's own autocast region around the whole run also trains correctly: autocast caches its
low-precision copy of every weight until its outermost region exits, so a loop inside one
region would keep running the forward on the weights of step 1 while AdamW moved the fp32
weights along those stale gradients, and every step clears that cache after the update.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from rlhf.config.schema import SFTConfig
from rlhf.rollout.base import SamplingParams
from rlhf.rollout.hf import HFRolloutEngine

IGNORE = -100


def build_sft_example(prompt_ids: list[int], response_ids: list[int], eos_id: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels): labels are -100 on prompt tokens, the tokens themselves on response + EOS."""
    ids = list(prompt_ids) + list(response_ids) + [eos_id]
    labels = [IGNORE] * len(prompt_ids) + list(response_ids) + [eos_id]
    return ids, labels


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask`, `labels`, each (B, T)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (x, y) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of token t+1 given tokens <= t, over positions whose label is not -100.

    logits: (B, T, V); labels: (B, T) with -100 on prompt and padding.
    """
    shift_logits = logits[:, :-1].float()  # (B, T-1, V)
    shift_labels = labels[:, 1:]  # (B, T-1)
    return F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1),
                           ignore_index=IGNORE)


def lr_at(step: int, total_steps: int, cfg: SFTConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine to `min_lr_ratio * lr` (or constant)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def planned_steps(n_examples: int, cfg: SFTConfig) -> int:
    """Optimizer steps the run is scheduled for (the cosine horizon)."""
    per_epoch = math.ceil(n_examples / cfg.batch_size)
    total = per_epoch * cfg.epochs
    return min(total, cfg.max_steps) if cfg.max_steps > 0 else total


def tokenize_pairs(tokenizer, prompts: list[str], responses: list[str], prompt_format: str = "text"
                   ) -> list[tuple[list[int], list[int]]]:
    """Prompts are encoded exactly as the rollout encodes them (`encode_prompts`: the text with
    the tokenizer's BOS, or a chat list through the chat template with its generation prompt),
    responses on their own without special tokens, so the policy learns the ids it will
    continue from at rollout and the label mask falls exactly on the prompt's tokens."""
    from rlhf.data.sampling import encode_prompts  # loads pandas: only for the greedy check

    if len(prompts) != len(responses):
        raise ValueError(f"sft_warm_start: {len(prompts)} prompts but {len(responses)} responses; "
                         f"pass one response per prompt")
    p_ids = encode_prompts(list(prompts), tokenizer, prompt_format)
    r_ids = tokenizer(list(responses), add_special_tokens=False)["input_ids"]
    return [build_sft_example(p, r, tokenizer.eos_token_id) for p, r in zip(p_ids, r_ids)]


def epoch_batches(n_examples: int, batch_size: int, epochs: int, generator: torch.Generator):
    """(epoch, indices) for each batch: a fresh seeded permutation per epoch."""
    for epoch in range(epochs):
        order = torch.randperm(n_examples, generator=generator).tolist()
        for i in range(0, n_examples, batch_size):
            yield epoch, order[i: i + batch_size]


@contextlib.contextmanager
def cpu_threads(n: int, device: torch.device):
    """Run with `n` torch CPU threads (then restore); n <= 0 or a GPU device leaves them as they are."""
    before = torch.get_num_threads()
    if n > 0 and device.type == "cpu":
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def probe_accuracy(model, tokenizer, examples: list[tuple[list[int], list[int]]]) -> float:
    """Share of `examples` whose greedy response is exactly the labeled response + EOS."""
    prompts = [[t for t, y in zip(ids, labels) if y == IGNORE] for ids, labels in examples]
    targets = [[y for y in labels if y != IGNORE] for _, labels in examples]
    params = SamplingParams(temperature=0.0, max_tokens=max(len(t) for t in targets))
    out = HFRolloutEngine(model, tokenizer, batch_size=256).generate(prompts, params)
    return sum(r == t for r, t in zip(out.response_ids, targets)) / len(targets)


def sft_warm_start(model, tokenizer, prompts: list[str], responses: list[str], cfg: SFTConfig, seed: int = 0,
                   progress: bool = True, log_every: int | None = None,
                   should_stop: Callable[[], bool] | None = None, prompt_format: str = "text",
                   autocast_dtype: str = "") -> dict[str, float]:
    """Fine-tune `model` in place on (prompt, response) pairs (prompts in `prompt_format`).

    Stops at the first of `max_steps`, `epochs`, `max_seconds`, or (if `stop_at_accuracy` > 0)
    greedy exact-match accuracy >= `stop_at_accuracy` on the first `probe_size` training
    pairs, checked every `probe_every` steps, or `should_stop()` returning True (checked
    after every step; e.g. a cancellation or a wall-clock budget set elsewhere). Returns `{"sft/steps", "sft/epochs", "sft/loss"
    (mean of the last `log_every` steps), "sft/seconds", "sft/tokens"}` and, when probing,
    `"sft/probe_accuracy"`. Prints a line every `log_every` steps. `autocast_dtype` ("" = off,
    "bfloat16") runs each step's forward and loss under `torch.autocast`.
    """
    if cfg.lr_schedule not in ("cosine", "constant"):
        raise ValueError(f"model.sft.lr_schedule is {cfg.lr_schedule!r}; choose 'cosine' or 'constant'")
    if cfg.epochs < 1 or cfg.batch_size < 1:
        raise ValueError(f"model.sft.epochs ({cfg.epochs}) and model.sft.batch_size ({cfg.batch_size}) must be >= 1")
    examples = tokenize_pairs(tokenizer, prompts, responses, prompt_format)
    if not examples:
        raise ValueError("sft_warm_start: no examples; pass at least one (prompt, response) pair")
    device = next(model.parameters()).device
    with cpu_threads(cfg.num_threads, device):
        metrics = _train(model, tokenizer, examples, cfg, seed, progress, log_every or cfg.log_every, device,
                         should_stop, autocast_dtype)
    model.eval()
    return metrics


def _train(model, tokenizer, examples, cfg: SFTConfig, seed: int, progress: bool, log_every: int,
           device: torch.device, should_stop: Callable[[], bool] | None = None,
           autocast_dtype: str = "") -> dict[str, float]:
    total = planned_steps(len(examples), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    probe = examples[: cfg.probe_size] if cfg.stop_at_accuracy > 0 else []
    model.train()
    start, step, tokens, recent, metrics = time.perf_counter(), 0, 0, [], {}
    for epoch, idx in epoch_batches(len(examples), cfg.batch_size, cfg.epochs, torch.Generator().manual_seed(seed)):
        batch = {k: v.to(device) for k, v in collate([examples[j] for j in idx], tokenizer.pad_token_id).items()}
        loss = _train_step(model, opt, batch, lr_at(step, total, cfg), cfg.grad_clip, autocast_dtype)
        recent = (recent + [loss])[-log_every:]
        step, tokens = step + 1, tokens + int(batch["attention_mask"].sum())
        elapsed = time.perf_counter() - start
        if progress and (step % log_every == 0 or step == total):
            print(f"sft step {step}/{total} epoch {epoch} loss {sum(recent) / len(recent):.4f} "
                  f"lr {lr_at(step - 1, total, cfg):.2e} {elapsed:.1f}s", flush=True)
        if probe and step % cfg.probe_every == 0:
            metrics["sft/probe_accuracy"] = probe_accuracy(model, tokenizer, probe)
            if progress:
                print(f"sft step {step} greedy accuracy on {len(probe)} training problems "
                      f"{metrics['sft/probe_accuracy']:.3f} (stop at {cfg.stop_at_accuracy})", flush=True)
            if metrics["sft/probe_accuracy"] >= cfg.stop_at_accuracy:
                break
        if step >= total or elapsed >= cfg.max_seconds or (should_stop is not None and should_stop()):
            break
    return {"sft/steps": step, "sft/epochs": epoch + 1, "sft/loss": sum(recent) / len(recent),
            "sft/seconds": time.perf_counter() - start, "sft/tokens": tokens, **metrics}


def _autocast(device: torch.device, dtype: str):
    if not dtype:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def _train_step(model, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], lr: float,
                grad_clip: float, autocast_dtype: str = "") -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    with _autocast(batch["input_ids"].device, autocast_dtype):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        loss = sft_loss(logits, batch["labels"])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    # Inside a caller's autocast region the low-precision copies of the weights are cached
    # until that region exits: drop them, or the next forward runs on the weights before this step.
    torch.clear_autocast_cache()
    return float(loss.detach())
