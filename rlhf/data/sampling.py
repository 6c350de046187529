"""Which prompts a step sees, and how they become token ids.

`PromptSampler` is a seeded, resumable replacement for a shuffling DataLoader over row
indices: every epoch is a fresh permutation (seeded by `(seed, epoch)`), every row
appears at most once per epoch, and `state_dict()` is two integers, so a resumed run
draws exactly the batches the uninterrupted run would have drawn. With `drop_last` (as
verl's loader, `StatefulDataLoader(drop_last=True)`) an epoch's last partial batch is
skipped and the next batch starts a new epoch; without it, or when the rows do not fill
one batch, a batch that runs past the end of an epoch continues into the next one.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)
TRUNCATION_MODES = ("error", "left", "right")
PROMPT_FORMATS = ("text", "chat")


class PromptSampler:
    """Batches of row indices in `[0, n_rows)`: seeded global shuffle per epoch, each epoch's
    partial last batch dropped (`drop_last`) or continued into the next epoch."""

    def __init__(self, n_rows: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = False):
        if n_rows <= 0 or batch_size <= 0:
            raise ValueError(f"PromptSampler needs n_rows > 0 and batch_size > 0, got {n_rows}, {batch_size}")
        self.n_rows, self.batch_size, self.seed, self.shuffle = n_rows, batch_size, seed, shuffle
        self.drop_last = drop_last and n_rows >= batch_size
        self.epoch, self.cursor = 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """The row order of `epoch`: (n_rows,) int64."""
        if epoch != self._order_epoch:
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(self.n_rows) if self.shuffle
                           else np.arange(self.n_rows, dtype=np.int64))
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> np.ndarray:
        """The next batch: (batch_size,) int64 row indices."""
        if self.drop_last and self.n_rows - self.cursor < self.batch_size:
            self.epoch, self.cursor = self.epoch + 1, 0
        parts, need = [], self.batch_size
        while need:
            take = min(need, self.n_rows - self.cursor)
            parts.append(self.order(self.epoch)[self.cursor:self.cursor + take])
            self.cursor += take
            need -= take
            if self.cursor == self.n_rows:
                self.epoch, self.cursor = self.epoch + 1, 0
        return np.concatenate(parts).astype(np.int64)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "n_rows": self.n_rows, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("n_rows", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state was saved with {key}={state[key]}, this sampler has "
                                 f"{key}={getattr(self, key)}; resume with the same dataset and trainer.seed")
        if not 0 <= state["cursor"] < self.n_rows or state["epoch"] < 0:
            raise ValueError(f"sampler state epoch={state['epoch']} cursor={state['cursor']} is out of range "
                             f"for {self.n_rows} rows")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def _chat_messages(text: str, row: int) -> list[dict]:
    try:
        messages = json.loads(text)
    except ValueError:
        messages = None
    if not isinstance(messages, list):
        raise ValueError(f"prompt row {row} is not a JSON chat list ({text[:60]!r}); data.prompt_format=chat "
                         "expects '[{\"role\": \"user\", \"content\": ...}]' (verl layout), "
                         "else use prompt_format=text")
    return messages


def is_chat_list(text: str) -> bool:
    """Whether a prompt string is a verl chat list serialized as JSON (`[{"role", "content"}, ...]`)."""
    if not isinstance(text, str) or not text.lstrip().startswith("[{"):
        return False
    try:
        messages = json.loads(text)
    except ValueError:
        return False
    return (isinstance(messages, list) and len(messages) > 0 and
            all(isinstance(m, dict) and "role" in m and "content" in m for m in messages))


def _render_chat(texts: list[str], rows: list[int], tokenizer: Any) -> list[list[int]]:
    rendered = [tokenizer.apply_chat_template(_chat_messages(texts[i], i), add_generation_prompt=True, tokenize=False)
                for i in rows]
    return [list(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]]


def _chat_rows_in_text(texts: list[str], tokenizer: Any) -> list[int]:
    """Rows of a `prompt_format=text` table that are verl chat lists: rendered with the chat
    template (as verl renders them) rather than fed as raw JSON; refused without a template."""
    rows = [i for i, t in enumerate(texts) if is_chat_list(t)]
    if rows and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"prompt rows {rows[:5]} are chat lists ([{{\"role\": ..., \"content\": ...}}], verl's "
                         "layout) but the tokenizer has no chat template to render them; use a model whose tokenizer "
                         "has one, or write the prompts as plain text")
    if rows and not _warned_chat_in_text:
        _warned_chat_in_text.append(True)
        log.warning("data.prompt_format=text, but %d of %d prompts (first: row %d) are chat lists; they are "
                    "rendered with the chat template (set data.prompt_format=chat to say so)", len(rows),
                    len(texts), rows[0])
    return rows


_warned_chat_in_text: list[bool] = []


def encode_prompts(texts: list[str], tokenizer: Any, prompt_format: str = "text") -> list[list[int]]:
    """Token ids of each prompt, untruncated.

    text: `tokenizer(text)` with the tokenizer's own special tokens (e.g. BOS); a row that
    is a JSON chat list (verl's layout) is rendered as in chat mode, never fed as raw JSON.
    chat: the JSON chat list rendered by `apply_chat_template(add_generation_prompt=True)`,
    then tokenized without adding special tokens (the template places them), as verl does.
    """
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS} (data.prompt_format), got {prompt_format!r}")
    if not texts:
        return []
    texts = list(texts)
    if prompt_format == "text":
        chat = _chat_rows_in_text(texts, tokenizer)
        chat_set = set(chat)
        plain = [i for i in range(len(texts)) if i not in chat_set]
        out: list[list[int]] = [[] for _ in texts]
        if plain:
            for i, ids in zip(plain, tokenizer([texts[i] for i in plain], add_special_tokens=True)["input_ids"]):
                out[i] = list(ids)
        for i, ids in zip(chat, _render_chat(texts, chat, tokenizer) if chat else []):
            out[i] = ids
        return out
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.prompt_format=chat needs a tokenizer with a chat template; set one or use "
                         "data.prompt_format=text")
    return _render_chat(texts, list(range(len(texts))), tokenizer)


def truncate(ids: list[int], max_length: int, mode: str, row: int = 0) -> list[int]:
    """Keep at most `max_length` tokens: "left" keeps the end, "right" the start, "error" raises."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[len(ids) - max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "error":
        raise ValueError(f"prompt row {row} has {len(ids)} tokens, more than data.max_prompt_length={max_length}; "
                         "raise data.max_prompt_length, set data.truncation=left or right, or set "
                         "data.filter_overlong_prompts=true to drop such rows")
    raise ValueError(f"truncation must be one of {TRUNCATION_MODES} (data.truncation), got {mode!r}")


def tokenize_prompts(texts: list[str], tokenizer: Any, max_prompt_length: int, truncation: str = "error",
                     prompt_format: str = "text") -> list[list[int]]:
    """Prompts -> token id lists of at most `max_prompt_length` (see `encode_prompts`, `truncate`)."""
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation must be one of {TRUNCATION_MODES} (data.truncation), got {truncation!r}")
    return [truncate(ids, max_prompt_length, truncation, i)
            for i, ids in enumerate(encode_prompts(texts, tokenizer, prompt_format))]


def filter_overlong(df: pd.DataFrame, tokenizer: Any, max_prompt_length: int,
                    prompt_format: str = "text") -> pd.DataFrame:
    """Rows whose prompt fits in `max_prompt_length` tokens (fresh index); `attrs["n_overlong"]` counts the rest."""
    lengths = np.array([len(ids) for ids in encode_prompts(df["prompt"].tolist(), tokenizer, prompt_format)])
    keep = lengths <= max_prompt_length if len(df) else np.zeros(0, dtype=bool)
    out = df[keep].reset_index(drop=True)
    out.attrs = {**df.attrs, "n_overlong": int((~keep).sum())}
    return out


def expand_for_rollout(n_prompts: int, n: int, start: int = 0) -> np.ndarray:
    """Group ids of `n` responses per prompt, contiguous: (n_prompts * n,) int64, e.g. [0,0,1,1] for n=2."""
    return np.repeat(np.arange(start, start + n_prompts, dtype=np.int64), n)
