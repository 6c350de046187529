"""The PPO buffer as one small typed batch of tensors.

Layout (verl's): every row is `[left-padded prompt | right-padded response]`,
`input_ids` is (B, P + R), `responses` and every per-token quantity is (B, R) and
aligned with the response tokens; `response_mask` marks the real response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch


@dataclass
class PPOBatch:
    input_ids: torch.Tensor  # (B, P+R) long
    attention_mask: torch.Tensor  # (B, P+R) long, 0 on padding
    position_ids: torch.Tensor  # (B, P+R) long, 0 at the first real token
    responses: torch.Tensor  # (B, R) long
    response_mask: torch.Tensor  # (B, R) float, 1 on real response tokens
    scores: torch.Tensor  # (B,) float, the reward function's score per response
    group_ids: torch.Tensor  # (B,) long, one group per prompt (GRPO)
    rollout_log_probs: Optional[torch.Tensor] = None  # (B, R) the rollout engine's log-probs
    old_log_probs: Optional[torch.Tensor] = None  # (B, R) behaviour policy (round start)
    ref_log_probs: Optional[torch.Tensor] = None  # (B, R) frozen reference
    values: Optional[torch.Tensor] = None  # (B, R) critic at round start
    token_level_rewards: Optional[torch.Tensor] = None  # (B, R)
    advantages: Optional[torch.Tensor] = None  # (B, R)
    returns: Optional[torch.Tensor] = None  # (B, R)
    rollout_is_weights: Optional[torch.Tensor] = None  # (B, R) rollout-correction IS weights
    loss_mask: Optional[torch.Tensor] = None  # (B, R) response_mask minus rollout-rejected tokens

    @property
    def train_mask(self) -> torch.Tensor:
        """(B, R) the tokens that train: `response_mask` minus those rollout correction rejected.
        It is the mask of the advantage estimator, the critic and the actor alike (verl replaces
        its response_mask with it before computing advantages); `response_mask` itself keeps
        the tokens the forward passes score."""
        return self.loss_mask if self.loss_mask is not None else self.response_mask

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.responses.shape[1]

    def _map(self, fn) -> "PPOBatch":
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = fn(v) if isinstance(v, torch.Tensor) else v
        return PPOBatch(**kw)

    def select(self, idx: torch.Tensor | list[int] | slice) -> "PPOBatch":
        if isinstance(idx, list):
            idx = torch.as_tensor(idx, dtype=torch.long)
        return self._map(lambda t: t[idx])

    def to(self, device: torch.device | str) -> "PPOBatch":
        return self._map(lambda t: t.to(device))

    def with_(self, **kw) -> "PPOBatch":
        return replace(self, **kw)

    def seq_lengths(self) -> list[int]:
        """Real (unpadded) tokens per row: prompt plus response."""
        return self.attention_mask.sum(-1).tolist()

    def trimmed(self) -> "PPOBatch":
        """Drop prompt columns that are padding in every row and response columns past the
        longest response, so a micro-batch of short rows costs short compute."""
        P = self.prompt_width
        prompt_real = self.attention_mask[:, :P].sum(0) > 0
        first = int(prompt_real.nonzero()[0]) if prompt_real.any() else P - 1
        resp_real = self.response_mask.sum(0) > 0
        last = int(resp_real.nonzero()[-1]) + 1 if resp_real.any() else 1
        cols = torch.cat([torch.arange(first, P), torch.arange(P, P + last)])
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, torch.Tensor) or v.dim() < 2:
                kw[f.name] = v
            elif v.shape[1] == P + self.responses.shape[1]:
                kw[f.name] = v[:, cols.to(v.device)]
            else:
                kw[f.name] = v[:, :last]
        return PPOBatch(**kw)


def collate(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    scores: list[float],
    group_ids: list[int],
    pad_id: int,
    rollout_log_probs: list[list[float]] | None = None,
    prompt_width: int | None = None,
    response_width: int | None = None,
) -> PPOBatch:
    """Build the (B, P+R) layout from ragged token lists. `rollout_log_probs` rows that are
    empty ("not kept") must all be: then the batch has none; a mix raises naming a row."""
    B = len(prompt_ids)
    assert B == len(response_ids) == len(scores) == len(group_ids), "ragged inputs must have one entry per response"
    if rollout_log_probs is not None:
        kept = [len(lp) > 0 for lp in rollout_log_probs]
        if not any(kept):
            rollout_log_probs = None
        elif not all(kept):
            raise ValueError(f"row {kept.index(False)}: rollout_logprobs is empty while row {kept.index(True)} has "
                             "them; keep the rollout log-probs for every row or for none")
    P = prompt_width or max(len(p) for p in prompt_ids)
    R = response_width or max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + R), dtype=torch.long)
    rlp = torch.zeros((B, R), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        if len(p) > P or len(r) > R:
            raise ValueError(f"row {i}: prompt {len(p)} / response {len(r)} tokens exceed the widths {P} / {R}")
        input_ids[i, P - len(p):P] = torch.as_tensor(p, dtype=torch.long)
        input_ids[i, P:P + len(r)] = torch.as_tensor(r, dtype=torch.long)
        attn[i, P - len(p):P + len(r)] = 1
        if rollout_log_probs is not None:
            rlp[i, :len(r)] = torch.as_tensor(rollout_log_probs[i], dtype=torch.float32)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return PPOBatch(
        input_ids=input_ids,
        attention_mask=attn,
        position_ids=position_ids,
        responses=input_ids[:, P:].clone(),
        response_mask=attn[:, P:].float(),
        scores=torch.as_tensor(scores, dtype=torch.float32),
        group_ids=torch.as_tensor(group_ids, dtype=torch.long),
        rollout_log_probs=rlp if rollout_log_probs is not None else None,
    )
