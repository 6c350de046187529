"""Pandera model of a stored rollout table: the input of offline RLHF (`data.rollout_files`).

verl's prompt layout (flat or nested, as `PromptSchema` reads it) plus the response and,
optionally, what the behaviour policy and the reward left with it. A round's table that
the online pipeline writes (`ScoredRolloutSchema`, e.g. under `trainer.rollout_data_dir`)
is one; so is a verl-style parquet with `response` text and list-valued columns (lists are
stored here as JSON list strings, as everywhere in `schemas`).

Optional columns and what their absence means:
- `prompt_ids` / `response_ids`: tokenized with the policy's tokenizer at read time (the
  response gets EOS unless `finish_reason` says it was cut at the length limit).
- `rollout_logprobs`: the behaviour policy's per-token log-probs of the response tokens
  ('[]' or absent: unknown behaviour policy, so no rollout correction). Needs `response_ids`
  (the log-probs belong to those exact tokens).
- `group_id`: the group of responses to one prompt; absent, consecutive rows with the same
  prompt form a group.
- `finish_reason`: stop or length.
- `score`: the reward; absent or null, the row is scored by the reward function or model.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

from schemas.prompts import FINISH_REASONS, LOGPROBS_CHECK, PromptSchema, _is_json, logprobs_match_response


class StoredRolloutSchema(PromptSchema):
    """One stored response per row."""

    response: Series[str] = pa.Field(description="the response text")
    prompt_ids: Optional[Series[str]] = pa.Field(description="prompt token ids, JSON list string")
    response_ids: Optional[Series[str]] = pa.Field(description="response token ids, JSON list string")
    rollout_logprobs: Optional[Series[str]] = pa.Field(
        description="behaviour policy log-probs per response token, JSON list string ('[]' if unknown)")
    group_id: Optional[Series[int]] = pa.Field(ge=0, description="group of responses to one prompt")
    finish_reason: Optional[Series[str]] = pa.Field(isin=list(FINISH_REASONS), description="stop or length")
    score: Optional[Series[float]] = pa.Field(nullable=True, description="reward; null => scored when read")

    @pa.check("prompt_ids", "response_ids", "rollout_logprobs", element_wise=True,
              name="a JSON list string such as '[1, 2]'")
    def _json_list(cls, text: str) -> bool:
        return _is_json(text, list)

    @pa.dataframe_check(name=LOGPROBS_CHECK)
    def _logprobs_match_response(cls, df: pd.DataFrame) -> Series[bool]:
        if "rollout_logprobs" not in df or "response_ids" not in df:
            return pd.Series(True, index=df.index)
        return logprobs_match_response(df)

    class Config:
        strict = True
        name = "StoredRolloutSchema"
