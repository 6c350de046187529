"""A reward model: a sequence classifier with one output, read from a local directory.

`RewardModel(path).score(prompts, responses)` returns one float per pair: the
classifier's logit at the last non-pad token of `prompt + response` (a chat prompt,
a JSON list of {role, content}, is rendered with the tokenizer's chat template with
the response as the assistant turn). Pairs are length-sorted into batches and padded
on the right, so a pair's score does not depend on its batch. A non-finite score (NaN or
inf, from a diverged or corrupted checkpoint) is returned as it is with a warning naming
the rows; the trainer then drops the step and counts it (`early_stop.max_nonfinite_steps`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Sequence

log = logging.getLogger(__name__)


class RewardModel:
    def __init__(self, path: str, batch_size: int = 32, device: str = "cpu", max_length: int | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        _check_local_dir(path)
        self.path = path
        self.batch_size = batch_size
        self.device = device
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, use_safetensors=True, dtype="float32").to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model at {path} has num_labels={self.model.config.num_labels}; "
                             "a reward model needs exactly one output (num_labels=1)")
        _ensure_pad_token(self.tokenizer, self.model, path)
        self.tokenizer.padding_side = "right"

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """One reward per (prompt, response) pair, in input order."""
        if len(prompts) != len(responses):
            raise ValueError(f"RewardModel.score: {len(prompts)} prompts but {len(responses)} responses")
        texts = [render_pair(p, r, self.tokenizer) for p, r in zip(prompts, responses)]
        ids = [self._encode(t) for t in texts]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            for i, value in zip(chunk, self._forward([ids[i] for i in chunk])):
                out[i] = value
        bad = [i for i, value in enumerate(out) if not math.isfinite(value)]
        if bad:
            i = bad[0]
            log.warning("reward model at %s returned %s for %d of %d rows (first: row %d, text %r); the "
                        "update drops steps with non-finite rewards; check the checkpoint (dtype, corrupted "
                        "weights)", self.path, out[i], len(bad), len(out), i, texts[i][:80])
        return out

    def _encode(self, text: str) -> list[int]:
        kwargs = {"truncation": True, "max_length": self.max_length} if self.max_length else {}
        return self.tokenizer(text, add_special_tokens=True, **kwargs)["input_ids"]

    def _forward(self, batch: list[list[int]]) -> list[float]:
        import torch

        padded = self.tokenizer.pad({"input_ids": batch}, padding=True, return_tensors="pt")
        with torch.no_grad():
            logits = self.model(input_ids=padded["input_ids"].to(self.device),
                                attention_mask=padded["attention_mask"].to(self.device)).logits  # (B, 1)
        return logits[:, 0].float().cpu().tolist()


def render_pair(prompt: str, response: str, tokenizer) -> str:
    """`prompt + response`, or the chat template over a JSON chat prompt plus the response turn."""
    messages = _chat_messages(prompt)
    if messages is None or not getattr(tokenizer, "chat_template", None):
        return prompt + response
    return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)


def _chat_messages(prompt: str) -> list[dict] | None:
    if not prompt.startswith("["):
        return None
    try:
        messages = json.loads(prompt)
    except ValueError:
        return None
    ok = isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    return messages if ok else None


def _check_local_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"reward model directory {path!r} does not exist; set reward.model_path "
                                "to a local directory saved with save_pretrained (safetensors)")
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ValueError(f"reward model directory {path!r} has no .safetensors weights; re-save it with "
                         "model.save_pretrained(dir, safe_serialization=True)")


def _ensure_pad_token(tokenizer, model, path: str) -> None:
    """Padding needs a pad id, and the classifier finds the last token through the same id."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"reward model tokenizer at {path} has neither a pad nor an eos token; set pad_token")
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
