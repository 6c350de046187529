import json

import pytest

from rlhf.config import RewardConfig
from rlhf.config.registry import Registry
from rlhf.rewards import REWARDS, RewardError, compute_scores, get_reward_fn, parse_extra_info
from rlhf.rewards import arithmetic, gsm8k
from rlhf.rewards.gsm8k import compute_score, extract_solution

FILLER = " and so on" * 40  # 400 characters, no digits


# ---------------------------------------------------------------------------------
# GSM8K rule (verl semantics)
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, method, expected", [
    ("so she has 72 left.\n#### 72", "strict", "72"),
    ("#### 5 first, then corrected: #### 7", "strict", "7"),  # the last marker wins
    ("the answer is 72", "strict", None),  # no "#### " marker
    ("####72", "strict", None),  # the marker needs its space
    ("#### 1,234", "strict", "1234"),  # commas removed
    ("#### -5", "strict", "-5"),
    ("#### 3.75", "strict", "3.75"),
    ("#### $18", "strict", None),  # "$" between marker and number: no match, as in verl
    ("#### 18$", "strict", "18"),
    ("the answer is 72", "flexible", "72"),
    ("from 3 to 1,234 apples", "flexible", "1,234"),  # flexible keeps commas
    ("costs $18", "flexible", "18"),
    ("it is -5 degrees", "flexible", "-5"),
    ("2 then 42 .", "flexible", "42"),  # a lone "." is skipped
    ("the total is 72.", "flexible", "72."),  # the sentence's period is part of the match
    ("no number here", "flexible", None),
    ("just . here", "flexible", "."),  # only invalid matches: verl keeps the first
])
def test_extract_solution(text, method, expected):
    assert extract_solution(text, method) == expected


def test_only_the_last_300_characters_are_searched():
    assert extract_solution("#### 72" + FILLER, "strict") is None
    assert extract_solution("72" + FILLER, "flexible") is None
    inside = "#### 72" + FILLER[:293]  # the marker starts exactly 300 characters from the end
    assert len(inside) == 300 and extract_solution(inside, "strict") == "72"
    assert extract_solution("x" + inside, "strict") == "72"
    assert extract_solution(inside[1:], "strict") is None  # "### 72" is not the marker


def test_compute_score_outcomes():
    assert compute_score("#### 72", "72") == 1.0
    assert compute_score("#### 71", "72") == 0.0
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert compute_score("no answer", "72", format_score=0.1) == 0.0
    assert compute_score("#### 72", "72", format_score=0.1, score=2.0) == 2.0
    assert compute_score("answer: 72", "72", method="flexible") == 1.0
    assert compute_score("answer: 72", "72", method="strict") == 0.0
    assert compute_score("total 1,000", "1000", method="flexible", format_score=0.1) == 0.1
    assert isinstance(compute_score("#### 72", "72"), float)


def test_unknown_method_raises():
    with pytest.raises(ValueError, match="strict, flexible"):
        extract_solution("#### 1", "lenient")


def test_arithmetic_uses_the_same_rule():
    for text, gt in [("#### 68", "68"), ("#### 67", "68"), ("68", "68"), ("#### -12", "-12")]:
        for method in ("strict", "flexible"):
            expected = gsm8k.compute_score(text, gt, method, 0.1, 1.0)
            assert arithmetic.compute_score(text, gt, method, 0.1, 1.0) == expected
    assert arithmetic.compute_score("#### 68", "68") == 1.0


# ---------------------------------------------------------------------------------
# Registry and dispatch
# ---------------------------------------------------------------------------------


def test_registry_knows_the_builtin_sources():
    assert {"openai/gsm8k", "synthetic/arithmetic"} <= set(REWARDS.names())
    cfg = RewardConfig(format_score=0.1)
    assert get_reward_fn("openai/gsm8k")("#### 3", "3", {}, cfg) == 1.0
    assert get_reward_fn("synthetic/arithmetic")("#### 4", "3", {}, cfg) == 0.1


def test_unknown_data_source_lists_known_ones():
    with pytest.raises(RewardError, match=r"'lighteval/MATH'.*openai/gsm8k, synthetic/arithmetic"):
        get_reward_fn("lighteval/MATH")


def test_duplicate_registration_raises():
    reg = Registry("reward function")
    reg.add("openai/gsm8k", gsm8k.reward)
    with pytest.raises(ValueError, match="already registered"):
        reg.add("openai/gsm8k", arithmetic.reward)


def _rule_rows():
    return dict(
        data_sources=["openai/gsm8k", "synthetic/arithmetic", "openai/gsm8k", "synthetic/arithmetic"],
        responses=["#### 1,000", "#### 68", "#### 12", "the answer is 5"],
        ground_truths=["1000", "68", "13", "5"],
        extra_infos=[json.dumps({"index": 0}), {"index": 1}, None, ""],
        reward_styles=["rule"] * 4,
    )


def test_compute_scores_rule_rows():
    assert compute_scores(**_rule_rows(), cfg=RewardConfig(format_score=0.1)) == [1.0, 1.0, 0.1, 0.0]
    flexible = RewardConfig(gsm8k_method="flexible", format_score=0.1)
    # flexible keeps the comma of "1,000" (verl), so row 0 is wrong there
    assert compute_scores(**_rule_rows(), cfg=flexible) == [0.1, 1.0, 0.1, 1.0]


def test_compute_scores_passes_extra_info_as_dict():
    seen = []
    REWARDS.add("test/extra-info", lambda r, gt, extra, cfg: seen.append(extra) or 0.5)
    try:
        scores = compute_scores(["test/extra-info"] * 2, ["a", "b"], ["x", "y"], ['{"k": 1}', None],
                                ["rule"] * 2, RewardConfig())
    finally:
        REWARDS._items.pop("test/extra-info")
    assert scores == [0.5, 0.5] and seen == [{"k": 1}, {}]


@pytest.mark.parametrize("change, message", [
    (dict(reward_styles=["rule", "rule", "critic", "rule"]), r"row 2: reward_style 'critic'"),
    (dict(ground_truths=["1000", None, "13", "5"]), r"row 1: .*needs a ground_truth"),
    (dict(data_sources=["openai/gsm8k", "nope/x", "openai/gsm8k", "synthetic/arithmetic"]), r"'nope/x'"),
    (dict(extra_infos=["{", None, None, None]), r"row 0: extra_info is not a JSON"),
    (dict(extra_infos=["[1]", None, None, None]), r"row 0: extra_info must be a JSON object"),
    (dict(responses=["#### 1"]), r"data_sources has 4 rows but responses has 1"),
])
def test_compute_scores_errors_name_the_row(change, message):
    rows = {**_rule_rows(), **change}
    with pytest.raises(RewardError, match=message):
        compute_scores(**rows, cfg=RewardConfig())


def test_model_rows_without_reward_model_name_the_setting():
    rows = _rule_rows()
    rows["reward_styles"] = ["rule", "model", "rule", "model"]
    rows["ground_truths"] = ["1000", None, "13", None]
    with pytest.raises(RewardError, match=r"2 rows \(first: row 1\).*reward\.model_path"):
        compute_scores(**rows, cfg=RewardConfig())


def test_parse_extra_info():
    assert parse_extra_info(None, 0) == {} and parse_extra_info(float("nan"), 0) == {}
    assert parse_extra_info('{"split": "train"}', 0) == {"split": "train"}
    assert parse_extra_info({"a": 1}, 0) == {"a": 1}
