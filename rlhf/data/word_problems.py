"""Synthetic GSM8K-style word problems in verl's parquet layout.

    python -m rlhf.data.word_problems --output DIR [--n-train 5000] [--n-test 200] [--n-sft 500]

Each problem is a short story with two or three steps of arithmetic on small numbers
(sums and differences below 200, products of a one-digit count), the kind a 135M-parameter
instruct model can learn to solve. Rows follow verl's `examples/data_preprocess/gsm8k.py`
exactly: the prompt is one user message, `question + " " + INSTRUCTION`; `data_source` is
`openai/gsm8k` (so verl's and this project's GSM8K reward score it); `reward_model` holds
`{style: rule, ground_truth}`; `extra_info` holds `{split, index, answer, question}`, where
`answer` is a worked solution ending in `#### N`, as GSM8K's are (the SFT target). The same
files therefore train in verl unchanged. Splits never share a question; the same seed gives
the same files. Files are written atomically.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa

from rlhf.data.gsm8k import DATA_SOURCE, INSTRUCTION, VERL_SCHEMA, extract_solution
from rlhf.data.io import write_table_atomic

NAMES = ("Tom", "Mia", "Sam", "Ava", "Leo", "Zoe", "Max", "Ivy", "Ben", "Lily", "Noah", "Emma")
ITEMS = ("apples", "marbles", "stickers", "books", "cookies", "pencils", "shells", "cards", "coins", "toys")


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked steps, then "#### N"
    answer: int


def _gives_away(rng: np.random.Generator, who: str, item: str) -> Problem:
    a, b = int(rng.integers(10, 90)), int(rng.integers(5, 60))
    c = int(rng.integers(1, a + b))
    s = a + b
    q = (f"{who} has {a} {item}. {who} gets {b} more {item} and then gives {c} {item} to a friend. "
         f"How many {item} does {who} have now?")
    sol = f"{who} has {a} + {b} = {s} {item}.\nAfter giving {c} away, {who} has {s} - {c} = {s - c} {item}."
    return Problem(q, f"{sol}\n#### {s - c}", s - c)


def _boxes(rng: np.random.Generator, who: str, item: str) -> Problem:
    n, k, extra = int(rng.integers(2, 10)), int(rng.integers(2, 13)), int(rng.integers(1, 40))
    p = n * k
    q = (f"{who} buys {n} boxes of {item} with {k} {item} in each box, and already had {extra} {item}. "
         f"How many {item} does {who} have in total?")
    sol = f"The boxes hold {n} * {k} = {p} {item}.\nIn total {who} has {p} + {extra} = {p + extra} {item}."
    return Problem(q, f"{sol}\n#### {p + extra}", p + extra)


def _two_friends(rng: np.random.Generator, who: str, item: str) -> Problem:
    other = NAMES[(NAMES.index(who) + 1 + int(rng.integers(0, len(NAMES) - 1))) % len(NAMES)]
    a, more = int(rng.integers(5, 80)), int(rng.integers(2, 50))
    b = a + more
    q = (f"{who} has {a} {item}. {other} has {more} more {item} than {who}. "
         f"How many {item} do they have together?")
    sol = f"{other} has {a} + {more} = {b} {item}.\nTogether they have {a} + {b} = {a + b} {item}."
    return Problem(q, f"{sol}\n#### {a + b}", a + b)


def _spends(rng: np.random.Generator, who: str, item: str) -> Problem:
    del item
    n, price = int(rng.integers(2, 10)), int(rng.integers(2, 12))
    cost = n * price
    money = cost + int(rng.integers(1, 60))
    q = (f"{who} has {money} dollars and buys {n} notebooks that cost {price} dollars each. "
         f"How many dollars does {who} have left?")
    sol = f"The notebooks cost {n} * {price} = {cost} dollars.\n{who} has {money} - {cost} = {money - cost} dollars left."
    return Problem(q, f"{sol}\n#### {money - cost}", money - cost)


def _three_days(rng: np.random.Generator, who: str, item: str) -> Problem:
    a, b, c = (int(x) for x in rng.integers(3, 60, size=3))
    q = (f"{who} collects {a} {item} on Monday, {b} {item} on Tuesday and {c} {item} on Wednesday. "
         f"How many {item} does {who} collect in the three days?")
    sol = f"Monday and Tuesday give {a} + {b} = {a + b} {item}.\nWith Wednesday, {a + b} + {c} = {a + b + c} {item}."
    return Problem(q, f"{sol}\n#### {a + b + c}", a + b + c)


TEMPLATES: tuple[Callable[[np.random.Generator, str, str], Problem], ...] = (
    _gives_away, _boxes, _two_friends, _spends, _three_days)


def make_problems(n: int, rng: np.random.Generator, seen: set[str]) -> list[Problem]:
    """`n` problems whose questions are not in `seen` (added to it), templates in turn."""
    out: list[Problem] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could not draw {n} distinct word problems; ask for fewer")
        template = TEMPLATES[len(out) % len(TEMPLATES)]
        p = template(rng, NAMES[int(rng.integers(0, len(NAMES)))], ITEMS[int(rng.integers(0, len(ITEMS)))])
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    return out


def to_verl_rows(problems: Sequence[Problem], split: str) -> list[dict]:
    """Problems as rows of verl's GSM8K layout (see the module docstring)."""
    rows = []
    for i, p in enumerate(problems):
        assert extract_solution(p.solution) == str(p.answer), f"worked solution of row {i} ends in the wrong answer"
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.question + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
            "extra_info": {"split": split, "index": i, "answer": p.solution, "question": p.question},
        })
    return rows


def make_splits(sizes: dict[str, int], seed: int = 0) -> dict[str, pa.Table]:
    """{split: verl-layout table} with no question shared between splits."""
    rng, seen = np.random.default_rng(seed), set()
    return {split: pa.Table.from_pylist(to_verl_rows(make_problems(n, rng, seen), split), schema=VERL_SCHEMA)
            for split, n in sizes.items()}


def write_splits(output_dir: str, sizes: dict[str, int], seed: int = 0) -> dict[str, str]:
    """`<output_dir>/<split>.parquet` for each split; returns {split: path}."""
    written = {}
    for split, table in make_splits(sizes, seed).items():
        path = os.path.join(output_dir, f"{split}.parquet")
        write_table_atomic(table, path)
        written[split] = path
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.data.word_problems", description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="directory for train.parquet, test.parquet, sft.parquet")
    p.add_argument("--n-train", type=int, default=5000, help="PPO prompts")
    p.add_argument("--n-test", type=int, default=200, help="held-out problems for validation")
    p.add_argument("--n-sft", type=int, default=500, help="labeled problems for a warm-start (0: no sft.parquet)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = {"train": args.n_train, "test": args.n_test} | ({"sft": args.n_sft} if args.n_sft > 0 else {})
    for split, path in write_splits(args.output, sizes, args.seed).items():
        print(f"word problems {split}: wrote {sizes[split]} rows to {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
