"""The synthetic arithmetic task: determinism, disjoint splits, correct answers."""

import json
import re

import pytest

from rlhf.config import SyntheticDataConfig
from rlhf.data.arithmetic import make_arithmetic, make_splits, problem_space_size, solution_text
from rlhf.data.validation import validate_prompts
from schemas import PromptSchema


def test_rows_are_valid_short_and_correct():
    df = make_arithmetic(200, digits=2, operators="+-*", n_steps=2, seed=3)
    PromptSchema.validate(df)
    assert set(df["data_source"]) == {"synthetic/arithmetic"} and set(df["ability"]) == {"math"}
    assert set(df["reward_style"]) == {"rule"}
    for prompt, truth in zip(df["prompt"], df["ground_truth"]):
        assert re.fullmatch(r"\d+([+\-*]\d+){2}=", prompt), prompt
        assert int(truth) == eval(prompt[:-1])  # noqa: S307 - digits and operators only
    assert df["prompt"].is_unique
    assert {o for p in df["prompt"] for o in re.findall(r"[+\-*]", p)} == {"+", "-", "*"}


def test_default_prompt_and_answer_fit_the_tiny_model():
    df = make_arithmetic(500)
    longest = max(len(p) + len(solution_text(t)) for p, t in zip(df["prompt"], df["ground_truth"]))
    assert longest <= 14 < 32
    assert solution_text("68") == "#### 68" and solution_text("-4") == "#### -4"
    assert re.fullmatch(r"\d{1,2}\+\d{1,2}=", df.loc[0, "prompt"])


def test_same_seed_same_table_other_seed_other_table():
    a = make_arithmetic(50, seed=7)
    assert a.equals(make_arithmetic(50, seed=7))
    assert not a["prompt"].equals(make_arithmetic(50, seed=8)["prompt"])


def test_large_problem_space_uses_rejection_sampling():
    assert problem_space_size(4, "+-", 2) > 2_000_000
    df = make_arithmetic(300, digits=4, operators="+-", n_steps=2, seed=1)
    assert df["prompt"].is_unique and len(df) == 300
    for prompt, truth in zip(df["prompt"], df["ground_truth"]):
        assert int(truth) == eval(prompt[:-1])  # noqa: S307


def test_splits_are_disjoint_sized_and_seeded():
    cfg = SyntheticDataConfig(n_sft=300, n_train=9800, n_val=100, seed=5)  # 10200 > 10000 problems exist
    splits = make_splits(cfg)
    assert {k: len(v) for k, v in splits.items()} == {"sft": 300, "train": 9800, "val": 100}
    sets = {k: set(v["prompt"]) for k, v in splits.items()}
    assert not sets["sft"] & sets["train"] and not sets["sft"] & sets["val"] and not sets["train"] & sets["val"]
    assert len(sets["val"]) == 100 and len(sets["sft"]) == 300
    assert len(sets["train"]) == 10000 - 400  # space exhausted: train repeats only its own problems
    for name, df in splits.items():
        validate_prompts(df, source=name)
        assert {json.loads(x)["split"] for x in df["extra_info"]} == {name}
    again = make_splits(cfg)
    assert all(again[k].equals(splits[k]) for k in splits)
    other = make_splits(SyntheticDataConfig(n_sft=300, n_train=9800, n_val=100, seed=6))
    assert not other["val"]["prompt"].equals(splits["val"]["prompt"])


def test_impossible_sizes_and_bad_knobs_raise():
    with pytest.raises(ValueError, match="only 100 distinct problems"):
        make_splits(SyntheticDataConfig(n_sft=90, n_train=10, n_val=10, digits=1))
    with pytest.raises(ValueError, match="operators"):
        make_arithmetic(5, operators="/")
    with pytest.raises(ValueError, match="n_steps"):
        make_arithmetic(5, n_steps=0)
