"""Pandera models of the prompt, rollout and scored-rollout tables.

verl's dataset layout, flattened: verl nests `reward_model = {style, ground_truth}` and
keeps `prompt` as a chat list and `extra_info` as a dict; here every column is a scalar
so the tables validate fast and cross task boundaries as plain parquet.

Storage conventions (one per column kind, so any reader can decode them):
- `prompt` is plain text, or, for `prompt_format="chat"`, the chat list
  `[{"role": ..., "content": ...}, ...]` serialized with `json.dumps`.
- `extra_info` is a JSON object string (verl's `extra_info`, kept opaque).
- `prompt_ids`, `response_ids` and `rollout_logprobs` are JSON list strings
  (`"[12, 7, 3]"`); `dump_json_column` / `load_json_column` convert them.
- A missing `ground_truth` (allowed only for `reward_style == "model"`) is null (NA).
"""

from __future__ import annotations

import json
from typing import Any, Iterable

import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

REWARD_STYLES = ("rule", "model")
FINISH_REASONS = ("stop", "length")

GROUND_TRUTH_CHECK = "ground_truth set (not null) when reward_style is rule"
LOGPROBS_CHECK = "rollout_logprobs has one value per response token (or is '[]')"


def logprobs_match_response(df: pd.DataFrame) -> pd.Series:
    """Per row: `rollout_logprobs` (a JSON list) holds one value per `response_ids` token, or
    none (`[]`: the engine gave no log-probs)."""
    def ok(ids: str, lps: str) -> bool:
        try:
            n_lp = len(json.loads(lps))
            return n_lp == 0 or n_lp == len(json.loads(ids))
        except (TypeError, ValueError):
            return False

    return pd.Series([ok(i, lp) for i, lp in zip(df["response_ids"], df["rollout_logprobs"])], index=df.index)


# Row-wise checks over several columns, and the column each one is about (for error messages).
DATAFRAME_CHECK_COLUMNS = {GROUND_TRUTH_CHECK: "ground_truth", LOGPROBS_CHECK: "rollout_logprobs"}


def _is_json(text: Any, kind: type) -> bool:
    if not isinstance(text, str):
        return False
    try:
        return isinstance(json.loads(text), kind)
    except ValueError:
        return False


def _not_blank(s: pd.Series) -> pd.Series:
    return s.str.strip().str.len() > 0


def _chat_has_content(text: str) -> bool:
    """A prompt that is a JSON list must be a chat: {role, content} messages, some content non-blank."""
    if not text.lstrip().startswith("["):
        return True
    try:
        messages = json.loads(text)
    except ValueError:
        return True  # plain text that happens to start with "["
    return (isinstance(messages, list)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages)
            and any(m["content"].strip() for m in messages))


class PromptSchema(pa.DataFrameModel):
    """One prompt per row: what PPO samples from and how its responses are scored."""

    prompt: Series[str] = pa.Field(
        description="prompt text, or a JSON chat list [{role, content}] when data.prompt_format=chat")
    data_source: Series[str] = pa.Field(
        description="selects the reward function, e.g. openai/gsm8k or synthetic/arithmetic")
    ability: Series[str] = pa.Field(description="task family, e.g. math")
    reward_style: Series[str] = pa.Field(
        isin=list(REWARD_STYLES), description="verl's reward_model.style: rule (verifier) or model (reward model)")
    ground_truth: Series[str] = pa.Field(
        nullable=True, description="verl's reward_model.ground_truth; required when reward_style is rule")
    extra_info: Series[str] = pa.Field(description="verl's extra_info as a JSON object string, kept opaque")

    @pa.check("prompt", "data_source", name="a non-blank string")
    def _non_blank(cls, s: Series[str]) -> Series[bool]:
        return _not_blank(s)

    @pa.check("prompt", element_wise=True, name="a chat list of {role, content} messages with non-blank content")
    def _chat_prompt(cls, text: str) -> bool:
        return _chat_has_content(text)

    @pa.check("extra_info", element_wise=True, name="a JSON object string such as '{}'")
    def _extra_info_json(cls, text: str) -> bool:
        return _is_json(text, dict)

    @pa.dataframe_check(name=GROUND_TRUTH_CHECK)
    def _ground_truth_for_rule(cls, df: pd.DataFrame) -> Series[bool]:
        return ~((df["reward_style"] == "rule") & df["ground_truth"].isna())

    class Config:
        strict = True
        name = "PromptSchema"


class RolloutSchema(PromptSchema):
    """One sampled response per row; the `rollout.n` responses of a prompt share `group_id`."""

    response: Series[str] = pa.Field(description="decoded response text (special tokens removed)")
    prompt_ids: Series[str] = pa.Field(description="prompt token ids as a JSON list string, e.g. '[1, 5, 9]'")
    response_ids: Series[str] = pa.Field(
        description="response token ids as a JSON list string, ending with EOS when generation stopped there")
    group_id: Series[int] = pa.Field(ge=0, description="index of the prompt group (shared by its rollout.n responses)")
    rollout_logprobs: Series[str] = pa.Field(
        description="sampled-token log-probs under the rollout engine's weights, JSON list string ('[]' if not kept)")
    finish_reason: Series[str] = pa.Field(
        isin=list(FINISH_REASONS), description="stop (EOS) or length (hit max_response_length)")

    @pa.check("prompt_ids", "response_ids", "rollout_logprobs", element_wise=True,
              name="a JSON list string such as '[1, 2]'")
    def _json_list(cls, text: str) -> bool:
        return _is_json(text, list)

    @pa.dataframe_check(name=LOGPROBS_CHECK)
    def _logprobs_match_response(cls, df: pd.DataFrame) -> Series[bool]:
        return logprobs_match_response(df)

    class Config:
        strict = True
        name = "RolloutSchema"


class ScoredRolloutSchema(RolloutSchema):
    """A rollout with its scalar reward (before any KL penalty)."""

    score: Series[float] = pa.Field(description="reward-function or reward-model score of the response")

    class Config:
        strict = True
        name = "ScoredRolloutSchema"


def dump_json_column(values: Iterable[Any]) -> list[str]:
    """[[1, 2], [3]] -> ["[1, 2]", "[3]"]: the storage form of list-valued columns (lists, arrays, tensors)."""
    return [json.dumps(v.tolist() if hasattr(v, "tolist") else list(v)) for v in values]


def load_json_column(column: Iterable[str]) -> list[Any]:
    """Inverse of `dump_json_column`."""
    return [json.loads(v) for v in column]
