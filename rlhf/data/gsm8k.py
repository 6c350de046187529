"""GSM8K in verl's layout, from local files (no network).

    python -m rlhf.data.gsm8k --input DIR --output DIR [--flat [--prompt-format text]]

`--input` holds Hugging Face GSM8K files for each split, in any of these forms:
`train.jsonl`, `train.parquet`, `train-*.parquet`, or the hub snapshot layout
`main/train-00000-of-00001.parquet` (likewise for `test`). Each row has `question`
and `answer` (worked solution ending in `#### N`).

Same rows as verl's `examples/data_preprocess/gsm8k.py`: the prompt is one user
message, `question + " " + INSTRUCTION`; the ground truth is the number after
`#### ` with commas removed; `extra_info = {split, index, answer, question}`.
Output: `train.parquet` / `test.parquet` in verl's nested layout, or with `--flat`
the flat `PromptSchema` layout (chat list as JSON, or the bare text with
`--prompt-format text`). Files are written atomically.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.data.io import flatten_verl, write_parquet_atomic, write_table_atomic
from rlhf.data.validation import DataValidationError, validate_prompts

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ANSWER_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")
SPLITS = ("train", "test")
_SPLIT_PATTERNS = ("{s}.jsonl", "{s}.parquet", "{s}-*.parquet", "{s}-*.jsonl",
                   "main/{s}.jsonl", "main/{s}.parquet", "main/{s}-*.parquet")

VERL_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()),
                              ("answer", pa.string()), ("question", pa.string())])),
])


def extract_solution(answer: str) -> str | None:
    """'... #### 1,234' -> '1234' (first `#### N` match, commas removed); None if there is none."""
    match = ANSWER_PATTERN.search(answer)
    return match.group(1).replace(",", "") if match else None


def find_split_files(input_dir: str, split: str) -> list[str]:
    """The files of one split, first matching pattern of `_SPLIT_PATTERNS` (shards sorted)."""
    for pattern in _SPLIT_PATTERNS:
        files = sorted(glob.glob(os.path.join(input_dir, pattern.format(s=split))))
        if files:
            return files
    looked = ", ".join(p.format(s=split) for p in _SPLIT_PATTERNS)
    raise DataValidationError(f"{input_dir}: no GSM8K '{split}' file found (looked for {looked}); "
                              "download openai/gsm8k (config 'main') there first")


def _load_jsonl(path: str) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as e:
                raise DataValidationError(f"{path}: line {line_no} is not valid JSON ({e}); fix or remove it") from e
    return records


def load_records(path: str) -> list[dict]:
    """Rows of a .jsonl or .parquet file, each checked to hold string `question` and `answer`."""
    if path.endswith(".jsonl"):
        records = _load_jsonl(path)
    else:
        try:
            records = pq.read_table(path, columns=["question", "answer"]).to_pylist()
        except (pa.ArrowException, OSError, KeyError) as e:
            raise DataValidationError(f"{path}: cannot read columns question/answer from parquet ({e})") from e
    for i, r in enumerate(records):
        for key in ("question", "answer"):
            if not isinstance(r.get(key), str):
                raise DataValidationError(f"{path}: row {i} column '{key}' is {r.get(key)!r}, expected a string "
                                          "(GSM8K rows have question and answer)")
    return records


def to_verl_row(record: dict, split: str, index: int, source: str = "") -> dict[str, Any]:
    """One GSM8K record -> one row of verl's nested layout."""
    solution = extract_solution(record["answer"])
    if solution is None:
        raise DataValidationError(f"{source}: row {index} column 'answer' has no '#### <number>' final answer: "
                                  f"{record['answer'][-80:]!r}; fix the row or remove it")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": record["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": index, "answer": record["answer"], "question": record["question"]},
    }


def build_split(input_dir: str, split: str) -> pa.Table:
    """All records of a split (shards concatenated, indices running across them) in verl's layout."""
    rows: list[dict] = []
    for path in find_split_files(input_dir, split):
        rows += [to_verl_row(r, split, len(rows) + i, path) for i, r in enumerate(load_records(path))]
    if not rows:
        raise DataValidationError(f"{input_dir}: the '{split}' split has no rows")
    return pa.Table.from_pylist(rows, schema=VERL_SCHEMA)


def write_split(table: pa.Table, path: str, flat: bool = False, prompt_format: str = "chat") -> int:
    """Write one split; returns the row count. Flat tables are validated against PromptSchema first."""
    if not flat:
        write_table_atomic(table, path)
        return table.num_rows
    df = flatten_verl(table, path)
    if prompt_format == "text":
        df["prompt"] = [row[0]["content"] for row in table.column("prompt").to_pylist()]
    write_parquet_atomic(validate_prompts(df, path), path)
    return len(df)


def preprocess(input_dir: str, output_dir: str, flat: bool = False, prompt_format: str = "chat",
               splits: Sequence[str] = SPLITS) -> dict[str, str]:
    """GSM8K files in `input_dir` -> `<output_dir>/<split>.parquet`; returns {split: path}."""
    if prompt_format not in ("chat", "text"):
        raise ValueError(f"prompt_format must be 'chat' or 'text', got {prompt_format!r}")
    written = {}
    for split in splits:
        path = os.path.join(output_dir, f"{split}.parquet")
        n = write_split(build_split(input_dir, split), path, flat, prompt_format)
        print(f"gsm8k {split}: wrote {n} rows to {path}", flush=True)
        written[split] = path
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.data.gsm8k", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="directory with the GSM8K train/test files")
    parser.add_argument("--output", required=True, help="directory for train.parquet and test.parquet")
    parser.add_argument("--flat", action="store_true", help="write the flat PromptSchema layout instead of verl's")
    parser.add_argument("--prompt-format", choices=("chat", "text"), default="chat",
                        help="with --flat: keep the chat list as JSON (chat) or the bare user text (text)")
    parser.add_argument("--splits", default=",".join(SPLITS), help="comma-separated splits to convert")
    args = parser.parse_args(argv)
    try:
        preprocess(args.input, args.output, args.flat, args.prompt_format, [s for s in args.splits.split(",") if s])
    except DataValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
