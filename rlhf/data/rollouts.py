"""Read, complete and write stored rollout tables (`schemas.StoredRolloutSchema`).

`read_rollout_table` accepts a parquet file, a directory of them or an fsspec URI: the
prompt columns in verl's nested layout or the flat one (as `read_prompts`), plus
`response` and the optional rollout columns, list-valued (verl style) or JSON strings.
`complete_rollouts` turns it into the `RolloutSchema` table a round trains on: token ids
from the policy's tokenizer where they are missing, groups, finish reasons. Every problem
raises `DataValidationError` naming the file or table, the row and the column.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from rlhf.data.io import (_display_name, _read_table, flatten_verl, list_parquet_files, resolve_path,
                          write_parquet_atomic)
from rlhf.data.validation import DataValidationError, validate_frame
from schemas.prompts import RolloutSchema
from schemas.rollouts import StoredRolloutSchema

ROLLOUT_COLUMNS = ("response", "prompt_ids", "response_ids", "rollout_logprobs", "group_id", "finish_reason", "score")
LIST_COLUMNS = ("prompt_ids", "response_ids", "rollout_logprobs")


def _as_json_list(value: Any) -> Any:
    """A list-valued cell (list, array, or already a JSON string) as a JSON list string."""
    if value is None or isinstance(value, str):
        return value
    if hasattr(value, "tolist"):
        value = value.tolist()
    return json.dumps(list(value)) if isinstance(value, (list, tuple)) else value


def _scores(values: list, name: str) -> pd.Series:
    """Float scores; null stays NaN (scored when read), anything not a number raises."""
    raw = pd.Series(values, dtype=object)
    out = pd.to_numeric(raw, errors="coerce").astype(np.float64)
    bad = [i for i, (r, v) in enumerate(zip(raw, out)) if r is not None and not pd.isna(r) and np.isnan(v)]
    if bad:
        raise _bad_rows(bad, f"column 'score' holds {raw[bad[0]]!r}, not a number", name,
                        "store a float score, or null to have the row scored")
    return out


def _read_file(fs, path: str, name: str, base_dir: str) -> pd.DataFrame:
    table = _read_table(fs, path, name)
    if "response" not in table.column_names:
        raise DataValidationError(f"{name}: missing column 'response'; a rollout table holds the prompt columns "
                                  f"(verl layout) plus response and optionally {', '.join(ROLLOUT_COLUMNS[1:])}")
    present = [c for c in ROLLOUT_COLUMNS if c in table.column_names]
    prompts = flatten_verl(table.drop_columns(present), name)
    cols = {c: table.column(c).to_pylist() for c in present}
    for c in LIST_COLUMNS:
        if c in cols:
            cols[c] = [_as_json_list(v) for v in cols[c]]
    if "score" in cols:
        cols["score"] = _scores(cols["score"], name)
    df = prompts.assign(**cols)
    return validate_frame(df, StoredRolloutSchema, name)


def read_rollout_table(path: str, base_dir: str = "") -> pd.DataFrame:
    """The stored rollouts at `path` as one `StoredRolloutSchema` table with `group_id` set:
    each file's groups (its `group_id`s, or runs of rows with the same prompt) numbered
    0, 1, ... across files, in order."""
    fs, files = list_parquet_files(resolve_path(path, base_dir))
    frames = []
    for i, f in enumerate(files):
        df = _read_file(fs, f, _display_name(fs, f), base_dir)
        key = df["group_id"].astype(str) if "group_id" in df else df["prompt"]
        frames.append(df.assign(_key=[f"{i}/{k}" for k in key]))
    out = pd.concat(frames, ignore_index=True)
    starts = (out["_key"] != out["_key"].shift()).to_numpy()
    out = out.drop(columns="_key").assign(group_id=np.cumsum(starts).astype(np.int64) - 1)
    out.attrs = {"source": path}
    return out


def _bad_rows(rows: list[int], what: str, source: str, fix: str) -> DataValidationError:
    shown = ", ".join(str(r) for r in rows[:5]) + (" ..." if len(rows) > 5 else "")
    return DataValidationError(f"{source}: rows {shown}: {what}; {fix}")


def _response_ids(df: pd.DataFrame, tokenizer, max_len: int) -> tuple[list[list[int]], list[str]]:
    """Token ids of the response texts, EOS appended unless the response was cut at `max_len`."""
    ids, reasons = [], []
    given = df["finish_reason"].tolist() if "finish_reason" in df else [None] * len(df)
    for text, reason in zip(df["response"], given):
        r = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = reason == "length" or (reason is None and len(r) >= max_len)
        ids.append(r if cut else r + [tokenizer.eos_token_id])
        reasons.append("length" if cut else "stop")
    return ids, reasons


def complete_rollouts(stored: pd.DataFrame, tokenizer, max_prompt_length: int, max_response_length: int,
                      n: int, prompt_ids: list[list[int]] | None = None, source: str = "rollout table"
                      ) -> pd.DataFrame:
    """A `RolloutSchema` table (plus `score` when the stored table has one, null where unscored)
    from a `read_rollout_table` result. `prompt_ids`: the tokenized prompts, used when the table
    has none. Every group must hold `n` (= `rollout.n`) responses; ids must fit the lengths."""
    df = stored.reset_index(drop=True)
    has_lp = "rollout_logprobs" in df and (df["rollout_logprobs"] != "[]").any()
    if has_lp and "response_ids" not in df:
        raise DataValidationError(f"{source}: column 'rollout_logprobs' is set but 'response_ids' is missing; "
                                  "log-probs belong to the exact tokens they were computed on: store response_ids "
                                  "with them, or drop rollout_logprobs")
    if "prompt_ids" not in df:
        if prompt_ids is None:
            raise ValueError("complete_rollouts: the table has no prompt_ids; pass the tokenized prompts")
        df["prompt_ids"] = [json.dumps(p) for p in prompt_ids]
    if "response_ids" not in df:
        ids, reasons = _response_ids(df, tokenizer, max_response_length)
        df["response_ids"] = [json.dumps(r) for r in ids]
        df["finish_reason"] = df["finish_reason"] if "finish_reason" in df else reasons
    if "finish_reason" not in df:
        eos = tokenizer.eos_token_id
        df["finish_reason"] = ["stop" if json.loads(r)[-1:] == [eos] else "length" for r in df["response_ids"]]
    if "rollout_logprobs" not in df:
        df["rollout_logprobs"] = "[]"
    _check_lengths(df, max_prompt_length, max_response_length, source)
    _check_groups(df, n, source)
    columns = list(RolloutSchema.to_schema().columns)
    out = validate_frame(df[columns], RolloutSchema, source)
    if "score" in df:
        out = out.assign(score=df["score"].to_numpy(dtype=np.float64))
    return out


def _check_lengths(df: pd.DataFrame, max_prompt: int, max_response: int, source: str) -> None:
    for column, limit, key in (("prompt_ids", max_prompt, "data.max_prompt_length"),
                               ("response_ids", max_response, "data.max_response_length")):
        lengths = [len(json.loads(x)) for x in df[column]]
        long = [i for i, n in enumerate(lengths) if n > limit]
        if long:
            raise _bad_rows(long, f"column {column!r} holds {lengths[long[0]]} tokens, more than {key}={limit}",
                            source, f"raise {key} or drop these rows")
        empty = [i for i, n in enumerate(lengths) if n == 0]
        if empty and column == "response_ids":
            raise _bad_rows(empty, "column 'response_ids' is empty", source, "drop these rows")


def _check_groups(df: pd.DataFrame, n: int, source: str) -> None:
    sizes = df.groupby("group_id", sort=False).size()
    bad = sizes[sizes != n]
    if len(bad):
        rows = df.index[df["group_id"] == bad.index[0]].tolist()
        raise _bad_rows(rows, f"column 'group_id': group {bad.index[0]} has {bad.iloc[0]} responses, and every "
                              f"group needs rollout.n={n}", source,
                        "set rollout.n to the table's group size, or fix the group_id column")
    first = df.groupby("group_id", sort=False).head(1)
    split = first["group_id"].duplicated()
    if split.any():  # rows of one group must be consecutive (a round takes a block of rows)
        raise _bad_rows(first.index[split].tolist(), "column 'group_id': a group's rows are not consecutive",
                        source, "sort the table by group")


def write_round_rollouts(out_dir: str, scored: pd.DataFrame, round_: int, rank: int = 0) -> str:
    """One round's scored rollouts as `<out_dir>/round_000001[_rank1].parquet`, atomically."""
    name = f"round_{round_:06d}" + (f"_rank{rank}" if rank else "") + ".parquet"
    path = f"{out_dir.rstrip('/')}/{name}"
    write_parquet_atomic(scored, path)
    return path
