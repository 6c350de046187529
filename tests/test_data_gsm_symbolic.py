"""GSM8K-style problems from reasoning-gym's gsm_symbolic templates, in verl's layout."""

import importlib.util
import json
import sys

import pyarrow.parquet as pq
import pytest

from rlhf.data.gsm8k import DATA_SOURCE, INSTRUCTION, VERL_SCHEMA
from rlhf.data.gsm_symbolic import SUFFIX, generator, main, make_splits, to_record
from rlhf.data.io import read_prompts
from rlhf.data.validation import DataValidationError
from rlhf.rewards.gsm8k import compute_score

needs_reasoning_gym = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="reasoning-gym is not installed (the optional 'gsm' extra: pip install -e '.[gsm]')")


@needs_reasoning_gym
def test_splits_are_verl_layout_distinct_valid_and_scored_by_the_strict_reward(tmp_path):
    assert main(["--output", str(tmp_path), "--n-train", "12", "--n-test", "4", "--n-sft", "4", "--seed", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft.parquet", "test.parquet", "train.parquet"]
    tables = {s: pq.read_table(tmp_path / f"{s}.parquet") for s in ("train", "test", "sft")}
    assert all(t.schema.equals(VERL_SCHEMA) for t in tables.values())
    questions = [r["question"] for t in tables.values() for r in t.column("extra_info").to_pylist()]
    assert len(set(questions)) == 20, "no question repeats within or across splits"
    for row in tables["sft"].to_pylist() + tables["test"].to_pylist():
        assert row["data_source"] == DATA_SOURCE and row["reward_model"]["style"] == "rule"
        (message,) = row["prompt"]
        assert message["content"] == row["extra_info"]["question"] + " " + INSTRUCTION
        assert SUFFIX.strip() not in message["content"]
        worked, gt = row["extra_info"]["answer"], row["reward_model"]["ground_truth"]
        assert worked.endswith(f"\n#### {gt}") and compute_score(worked, gt, "strict") == 1.0
    flat = read_prompts(str(tmp_path / "sft.parquet"))
    assert len(flat) == 4 and json.loads(flat["extra_info"][0])["split"] == "sft"


@needs_reasoning_gym
def test_the_seed_fixes_the_rows():
    a, b, c = (make_splits({"train": 6}, seed=s)["train"] for s in (5, 5, 6))
    assert a.equals(b) and not a.equals(c)


def _item(final: str, answer: str) -> dict:
    return {"question": "Ann has 3 boxes of 2 pens. How many pens?" + SUFFIX, "answer": answer,
            "metadata": {"answer_cot": f"She has 3 * 2 = 6 pens.\n#### {final}"}}


def test_the_final_line_takes_gsm8k_form_and_a_wrong_one_names_the_item():
    record = to_record(_item("6.0", "6"), "item 0")
    assert record == {"question": "Ann has 3 boxes of 2 pens. How many pens?",
                      "answer": "She has 3 * 2 = 6 pens.\n#### 6"}
    assert to_record(_item("2937.5", "2937.5"), "item 1")["answer"].endswith("#### 2937.5")
    with pytest.raises(DataValidationError, match=r"item 7: .*'#### 7' but the answer is '6'"):
        to_record(_item("7", "6"), "item 7")
    bad = _item("6", "6")
    bad["metadata"]["answer_cot"] = "She has 6 pens."
    with pytest.raises(DataValidationError, match="item 2: .*one '#### <number>' line"):
        to_record(bad, "item 2")


def test_without_reasoning_gym_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(DataValidationError, match=r"pip install -e '\.\[gsm\]'"):
        generator(0, 4)
