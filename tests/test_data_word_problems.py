"""Synthetic GSM8K-style word problems in verl's layout."""

import json
import re

import pyarrow.parquet as pq

from rlhf.data.gsm8k import DATA_SOURCE, INSTRUCTION, VERL_SCHEMA
from rlhf.data.io import read_prompts
from rlhf.data.word_problems import TEMPLATES, main, make_splits
from rlhf.rewards.gsm8k import compute_score


def _check_arithmetic(solution: str) -> None:
    """Every "a op b = c" step of a worked solution is right."""
    steps = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", solution)
    assert steps, solution
    for a, op, b, c in steps:
        assert eval(f"{a}{op}{b}") == int(c), solution


def test_splits_are_verl_layout_distinct_and_correct(tmp_path):
    assert main(["--output", str(tmp_path), "--n-train", "60", "--n-test", "20", "--n-sft", "10", "--seed", "1"]) == 0
    tables = {s: pq.read_table(tmp_path / f"{s}.parquet") for s in ("train", "test", "sft")}
    assert all(t.schema.equals(VERL_SCHEMA) for t in tables.values())
    questions = {s: [r["question"] for r in t.column("extra_info").to_pylist()] for s, t in tables.items()}
    assert sum(len(set(q)) for q in questions.values()) == 90, "no question repeats within or across splits"
    for row in tables["test"].to_pylist():
        assert row["data_source"] == DATA_SOURCE and row["ability"] == "math"
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"].endswith(" " + INSTRUCTION)
        gt = row["reward_model"]["ground_truth"]
        assert row["reward_model"]["style"] == "rule" and int(gt) >= 0
        _check_arithmetic(row["extra_info"]["answer"])
        assert compute_score(row["extra_info"]["answer"], gt, "strict") == 1.0
    flat = read_prompts(str(tmp_path / "test.parquet"))
    assert len(flat) == 20 and json.loads(flat["prompt"][0])[0]["role"] == "user"


def test_every_template_is_used_and_the_seed_fixes_the_rows():
    a, b = make_splits({"train": 2 * len(TEMPLATES)}, seed=5), make_splits({"train": 2 * len(TEMPLATES)}, seed=5)
    assert a["train"].equals(b["train"])
    assert not a["train"].equals(make_splits({"train": 2 * len(TEMPLATES)}, seed=6)["train"])
    starts = {q.split(" ")[1] for q in (r["question"] for r in a["train"].column("extra_info").to_pylist())}
    assert len(starts) >= 3  # "has", "buys", "collects", ...
