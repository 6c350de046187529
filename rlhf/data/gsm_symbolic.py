"""GSM8K-style problems from reasoning-gym's `gsm_symbolic` generators, in verl's parquet layout.

    python -m rlhf.data.gsm_symbolic --output DIR [--n-train 5000] [--n-test 200] [--n-sft 256] [--seed 0]

reasoning-gym (Apache-2.0; `pip install -e '.[gsm]'`) holds templates made from GSM8K's test
questions: each draws new names and numbers and writes the question and a worked answer ending
in `#### N`, offline. So these are GSM8K-style problems; a score on them is not a GSM8K test score.

Rows are GSM8K records (`question`, worked `answer`) converted as `rlhf.data.gsm8k` converts
GSM8K (verl's `examples/data_preprocess/gsm8k.py`): one user message `question + " " +
INSTRUCTION`, `data_source` `openai/gsm8k`, the ground truth the number after `#### `,
`extra_info = {split, index, answer, question}` (the worked answer is the SFT target).
Two departures from reasoning-gym's items, both to match GSM8K's form:
- its instruction suffix (" Give the result as your final answer. ...") is replaced by verl's;
- four templates write the final line as `#### 8.0` for the answer 8; that line is written
  `#### 8` (verl's strict score compares the strings). Any other disagreement between the
  worked answer and the answer raises, naming the item.
Templates are the ones reasoning-gym marks usable. Splits never share a question; the same seed
gives the same files; each file is checked against `PromptSchema`, then written atomically.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import pyarrow as pa

from rlhf.data.gsm8k import VERL_SCHEMA, extract_solution, to_verl_row
from rlhf.data.io import flatten_verl, write_table_atomic
from rlhf.data.validation import DataValidationError, validate_prompts

SOURCE = "reasoning-gym gsm_symbolic"
SUFFIX = " Give the result as your final answer. Do not include units."
INSTALL_HINT = "install it with pip install -e '.[gsm]' (or pip install reasoning-gym==0.1.25)"


def generator(seed: int, size: int):
    """reasoning-gym's `gsm_symbolic` dataset: item i is drawn from `Random(seed + i)`."""
    try:
        import reasoning_gym  # optional: only this data source needs it
    except ImportError as e:
        raise DataValidationError(f"{SOURCE} problems need the reasoning-gym package; {INSTALL_HINT}") from e
    return reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=size)


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def to_record(item: dict, where: str) -> dict[str, str]:
    """One reasoning-gym item -> a GSM8K record {question, answer (worked, ending in `#### N`)}."""
    answer = str(item["answer"])
    worked = str(item["metadata"]["answer_cot"]).rstrip()
    body, sep, final = worked.rpartition("\n#### ")
    if not sep or "####" in body:
        raise DataValidationError(f"{where}: the worked answer does not end in one '#### <number>' line: "
                                  f"{worked[-80:]!r}")
    if final != answer and _same_number(final, answer):
        final = answer  # '#### 8.0' for 8: GSM8K writes integers
    record = {"question": str(item["question"]).removesuffix(SUFFIX), "answer": f"{body}\n#### {final}"}
    if extract_solution(record["answer"]) != answer:
        raise DataValidationError(f"{where}: the worked answer ends in '#### {final}' but the answer is "
                                  f"{answer!r}; regenerate with another seed or report the template")
    return record


def make_splits(sizes: dict[str, int], seed: int = 0) -> dict[str, pa.Table]:
    """{split: verl-layout table}, items drawn in order; a question seen before is skipped."""
    total = sum(sizes.values())
    data = generator(seed, 2 * total + 1000)
    seen: set[str] = set()
    tables, i = {}, 0
    for split, n in sizes.items():
        rows: list[dict] = []
        while len(rows) < n:
            if i >= len(data):
                raise DataValidationError(f"could not draw {total} distinct {SOURCE} problems from {len(data)} items "
                                          f"(seed {seed}); ask for fewer")
            where = f"{SOURCE} item {i} (seed {seed})"
            record = to_record(data[i], where)
            i += 1
            if record["question"] not in seen:
                seen.add(record["question"])
                rows.append(to_verl_row(record, split, len(rows), where))
        tables[split] = pa.Table.from_pylist(rows, schema=VERL_SCHEMA)
    return tables


def write_splits(output_dir: str, sizes: dict[str, int], seed: int = 0) -> dict[str, str]:
    """`<output_dir>/<split>.parquet` for each split, each validated first; returns {split: path}."""
    written = {}
    for split, table in make_splits(sizes, seed).items():
        path = os.path.join(output_dir, f"{split}.parquet")
        validate_prompts(flatten_verl(table, path), path)
        write_table_atomic(table, path)
        written[split] = path
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.data.gsm_symbolic", description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="directory for train.parquet, test.parquet, sft.parquet")
    p.add_argument("--n-train", type=int, default=5000, help="PPO prompts")
    p.add_argument("--n-test", type=int, default=200, help="held-out problems for validation")
    p.add_argument("--n-sft", type=int, default=256, help="labeled problems for a warm-start (0: no sft.parquet)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = {"train": args.n_train, "test": args.n_test} | ({"sft": args.n_sft} if args.n_sft > 0 else {})
    try:
        written = write_splits(args.output, sizes, args.seed)
    except DataValidationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, path in written.items():
        print(f"gsm_symbolic {split}: wrote {sizes[split]} rows to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
