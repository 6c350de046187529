"""Pandera models of the prompt / rollout / scored-rollout tables, and the errors they produce."""

import json

import pandas as pd
import pandera.pandas as pa
import pytest

from rlhf.data.validation import DataValidationError, validate_frame, validate_prompts
from schemas import PromptSchema, RolloutSchema, ScoredRolloutSchema, dump_json_column, load_json_column


def prompts(n: int = 3, **overrides) -> pd.DataFrame:
    df = pd.DataFrame({
        "prompt": [f"{i}+1=" for i in range(n)],
        "data_source": ["synthetic/arithmetic"] * n,
        "ability": ["math"] * n,
        "reward_style": ["rule"] * n,
        "ground_truth": [str(i + 1) for i in range(n)],
        "extra_info": [json.dumps({"index": i}) for i in range(n)],
    })
    for column, values in overrides.items():
        df[column] = values
    return df


def rollouts(n: int = 2) -> pd.DataFrame:
    df = prompts(n)
    df["response"] = ["#### 1"] * n
    df["prompt_ids"] = dump_json_column([[1, 2, 3]] * n)
    df["response_ids"] = dump_json_column([[4, 5]] * n)
    df["group_id"] = list(range(n))
    df["rollout_logprobs"] = dump_json_column([[-0.5, -0.25]] * n)
    df["finish_reason"] = ["stop"] * n
    return df


def test_good_frames_pass():
    validate_prompts(prompts())
    model_rows = prompts(2, reward_style=["model", "model"], ground_truth=[None, None])
    assert validate_prompts(model_rows)["ground_truth"].isna().all()
    RolloutSchema.validate(rollouts())
    scored = rollouts()
    scored["score"] = [1.0, 0.0]
    ScoredRolloutSchema.validate(scored)


def test_stage_schemas_extend_the_prompt_schema():
    base = set(PromptSchema.to_schema().columns)
    rollout = set(RolloutSchema.to_schema().columns)
    scored = set(ScoredRolloutSchema.to_schema().columns)
    assert base < rollout < scored
    assert rollout - base == {"response", "prompt_ids", "response_ids", "group_id", "rollout_logprobs",
                              "finish_reason"}
    assert scored - rollout == {"score"}
    for schema in (PromptSchema, RolloutSchema, ScoredRolloutSchema):
        s = schema.to_schema()
        assert s.strict is True
        assert all(c.description for c in s.columns.values()), schema


@pytest.mark.parametrize("column, value, expected", [
    ("prompt", "   ", "non-blank"),
    ("prompt", json.dumps([{"role": "user", "content": ""}]), "chat list"),
    ("data_source", "", "non-blank"),
    ("reward_style", "human", "isin"),
    ("ground_truth", None, "ground_truth set (not null) when reward_style is rule"),
    ("extra_info", "not json", "JSON object"),
    ("prompt", None, "not null"),
])
def test_each_bad_value_is_reported_with_row_and_column(column, value, expected):
    df = prompts(4)
    df[column] = df[column].astype(object)
    df.loc[2, column] = value
    with pytest.raises(DataValidationError) as info:
        validate_prompts(df, source="train.parquet")
    msg = str(info.value)
    assert "train.parquet" in msg and f"column '{column}'" in msg and "row 2" in msg and expected in msg
    assert "row 0" not in msg and "row 1" not in msg and "row 3" not in msg
    assert "data.drop_invalid" in msg


def test_model_style_rows_may_lack_ground_truth_but_rule_rows_may_not():
    df = prompts(2, reward_style=["model", "rule"], ground_truth=[None, None])
    with pytest.raises(DataValidationError, match=r"row 1") as info:
        validate_prompts(df)
    assert "row 0" not in str(info.value)


def test_drop_invalid_drops_only_bad_rows_and_counts_them():
    df = prompts(5)
    df.loc[1, "reward_style"] = "bogus"
    df.loc[3, "prompt"] = ""
    out = validate_prompts(df, drop_invalid=True)
    assert out.attrs["n_dropped"] == 2
    assert out["prompt"].tolist() == ["0+1=", "2+1=", "4+1="]
    assert list(out.index) == [0, 1, 2]
    assert validate_prompts(prompts(2), drop_invalid=True).attrs["n_dropped"] == 0


def test_column_problems_raise_even_with_drop_invalid():
    with pytest.raises(DataValidationError, match=r"missing column\(s\) 'ability'"):
        validate_prompts(prompts().drop(columns=["ability"]), drop_invalid=True)
    with pytest.raises(DataValidationError, match=r"unexpected column\(s\) 'score'.*strict"):
        validate_prompts(prompts(score=[1.0, 2.0, 3.0]), drop_invalid=True)
    with pytest.raises(DataValidationError, match=r"column 'prompt' has dtype int64, expected str"):
        validate_prompts(prompts(prompt=[1, 2, 3]), drop_invalid=True)


def test_empty_and_all_invalid_frames_raise():
    with pytest.raises(DataValidationError, match="no rows"):
        validate_prompts(prompts(0))
    with pytest.raises(DataValidationError, match="all 2 rows are invalid"):
        validate_prompts(prompts(2, reward_style=["x", "y"]), drop_invalid=True)


def test_rollout_checks():
    bad = rollouts(3)
    bad.loc[0, "finish_reason"] = "timeout"
    bad.loc[1, "response_ids"] = "4, 5"
    bad.loc[2, "rollout_logprobs"] = "[-0.5]"
    with pytest.raises(DataValidationError) as info:
        validate_frame(bad, RolloutSchema, "rollouts.parquet")
    msg = str(info.value)
    assert "column 'finish_reason'" in msg and "row 0: got 'timeout'" in msg
    assert "column 'response_ids'" in msg and "row 1" in msg
    assert "column 'rollout_logprobs'" in msg and "row 2" in msg
    no_logprobs = rollouts(1)
    no_logprobs["rollout_logprobs"] = ["[]"]
    RolloutSchema.validate(no_logprobs)
    with pytest.raises(pa.errors.SchemaError):
        RolloutSchema.validate(prompts())  # a prompt table is not a rollout table


def test_json_column_helpers_round_trip():
    import numpy as np

    values = [[1, 2, 3], [], [7]]
    assert load_json_column(dump_json_column(values)) == values
    assert load_json_column(dump_json_column([np.array([4, 5]), (6,)])) == [[4, 5], [6]]
