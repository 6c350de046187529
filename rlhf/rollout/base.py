"""The rollout-engine protocol and its result type.

An engine turns tokenized prompts into `rollout.n` sampled responses each, with the
sampled tokens' log-probs under the engine's own weights (kept only to log the
rollout/trainer mismatch; the trainer recomputes behaviour log-probs itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # responses per prompt
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 => off
    max_tokens: int = 16  # data.max_response_length
    seed: int | None = None


@dataclass
class RolloutBatch:
    """Flat list of responses; response j belongs to prompt `prompt_index[j]`.

    Responses of one prompt are contiguous and share `group_ids[j]` (used by GRPO).
    `response_ids` stop at and include EOS when generation stopped there.
    """

    prompt_ids: list[list[int]] = field(default_factory=list)  # one per response (repeated n times)
    response_ids: list[list[int]] = field(default_factory=list)
    response_text: list[str] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)  # per response token, engine's weights
    finish_reason: list[str] = field(default_factory=list)  # "stop" (EOS) | "length"
    group_ids: list[int] = field(default_factory=list)
    prompt_index: list[int] = field(default_factory=list)  # index into the prompts passed in

    def __len__(self) -> int:
        return len(self.response_ids)

    def num_response_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """Sample `params.n` responses for every tokenized prompt (no padding in the input)."""
        ...

    def update_weights(self, model_dir: str) -> None:
        """Load new policy weights (a `save_pretrained` directory) into the running engine."""
        ...

    def release(self) -> None:
        """Give the device memory the engine holds back while a trainer in the same process updates
        the policy; the next weight update brings it back (a no-op for engines that hold none)."""
        ...

    def close(self) -> None:
        ...
