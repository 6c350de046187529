"""Reading verl's nested and the flat parquet layouts, validation errors, and atomic writes."""

import json
import os

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import rlhf.data.io as io
from rlhf.data.io import DataValidationError, read_prompts, write_parquet_atomic
from schemas import PromptSchema

CHAT_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def verl_rows(n: int = 3) -> list[dict]:
    """Rows shaped like verl's examples/data_preprocess/gsm8k.py output."""
    return [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i} + 1? Let's think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i, "answer": f"{i}+1={i + 1}\n#### {i + 1}",
                       "question": f"What is {i} + 1?"},
    } for i in range(n)]


def write_verl(path, rows) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def flat_frame(n: int = 3) -> pd.DataFrame:
    return pd.DataFrame({
        "prompt": [f"{i}+1=" for i in range(n)], "data_source": ["synthetic/arithmetic"] * n,
        "ability": ["math"] * n, "reward_style": ["rule"] * n, "ground_truth": [str(i + 1) for i in range(n)],
        "extra_info": ["{}"] * n,
    })


def test_verl_nested_parquet_is_flattened(tmp_path):
    path = tmp_path / "train.parquet"
    rows = verl_rows(3)
    write_verl(path, rows)
    schema = pq.read_schema(path)
    assert schema.field("prompt").type == CHAT_TYPE and pa.types.is_struct(schema.field("reward_model").type)

    df = read_prompts(str(path))
    PromptSchema.validate(df)
    assert list(df.columns) == list(PromptSchema.to_schema().columns)
    assert json.loads(df.loc[1, "prompt"]) == rows[1]["prompt"]
    assert df["reward_style"].tolist() == ["rule"] * 3
    assert df["ground_truth"].tolist() == ["1", "2", "3"]
    assert json.loads(df.loc[2, "extra_info"]) == rows[2]["extra_info"]
    assert df.attrs["n_dropped"] == 0


def test_flat_parquet_round_trips_through_atomic_write(tmp_path):
    df = flat_frame(4)
    df.loc[3, ["reward_style", "ground_truth"]] = ["model", None]
    path = tmp_path / "sub" / "flat.parquet"
    write_parquet_atomic(df, str(path))
    back = read_prompts(str(path))
    assert back["prompt"].tolist() == df["prompt"].tolist()
    assert back["ground_truth"].tolist()[:3] == ["1", "2", "3"] and pd.isna(back.loc[3, "ground_truth"])
    assert os.listdir(path.parent) == ["flat.parquet"]


def test_directory_and_file_uri_and_list(tmp_path):
    write_verl(tmp_path / "a.parquet", verl_rows(2))
    write_parquet_atomic(flat_frame(3), str(tmp_path / "b.parquet"))
    (tmp_path / "notes.txt").write_text("not data")
    df = read_prompts(str(tmp_path))
    assert len(df) == 5 and list(df.index) == list(range(5))
    assert df["data_source"].tolist() == ["openai/gsm8k"] * 2 + ["synthetic/arithmetic"] * 3
    uri = read_prompts(f"file://{tmp_path}/a.parquet")
    assert uri["ground_truth"].tolist() == ["1", "2"]
    both = read_prompts([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")])
    assert len(both) == 5


def test_extra_columns_are_kept_in_extra_info(tmp_path):
    rows = verl_rows(2)
    for i, r in enumerate(rows):
        r["question"] = f"q{i}"
    write_verl(tmp_path / "x.parquet", rows)
    df = read_prompts(str(tmp_path / "x.parquet"))
    info = json.loads(df.loc[1, "extra_info"])
    assert info["question"] == "What is 1 + 1?"  # extra_info's own key wins over the column
    df2 = read_prompts(str(_with_stray_column(tmp_path)))
    assert json.loads(df2.loc[0, "extra_info"])["difficulty"] == 3


def _with_stray_column(tmp_path):
    table = pa.Table.from_pylist(verl_rows(1)).append_column("difficulty", pa.array([3]))
    pq.write_table(table, tmp_path / "stray.parquet")
    return tmp_path / "stray.parquet"


def test_bad_rows_in_nested_file_name_file_row_and_column(tmp_path):
    rows = verl_rows(4)
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    rows[3]["reward_model"] = {"style": "human", "ground_truth": "4"}
    path = tmp_path / "bad.parquet"
    write_verl(path, rows)
    with pytest.raises(DataValidationError) as info:
        read_prompts(str(path))
    msg = str(info.value)
    assert str(path) in msg
    assert "column 'ground_truth'" in msg and "row 2" in msg
    assert "column 'reward_style'" in msg and "row 3: got 'human'" in msg
    df = read_prompts(str(path), drop_invalid=True)
    assert df.attrs["n_dropped"] == 2 and df["ground_truth"].tolist() == ["1", "2"]


def test_missing_column_and_wrong_type_and_wrong_struct(tmp_path):
    no_ability = pa.Table.from_pylist([{k: v for k, v in r.items() if k != "ability"} for r in verl_rows(2)])
    pq.write_table(no_ability, tmp_path / "a.parquet")
    with pytest.raises(DataValidationError, match=r"a\.parquet: missing column\(s\) ability"):
        read_prompts(str(tmp_path / "a.parquet"))

    df = flat_frame(2)
    df["ability"] = [1, 2]  # (numeric ground truths are read as text: tests/test_ground_truth.py)
    write_parquet_atomic(df, str(tmp_path / "b.parquet"))
    wrong_type = r"(?s)b\.parquet.*column 'ability' has dtype int64, expected str values \(row 0: 1;"
    with pytest.raises(DataValidationError, match=wrong_type):
        read_prompts(str(tmp_path / "b.parquet"), drop_invalid=True)

    rows = verl_rows(1)
    rows[0]["reward_model"] = "rule:1"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    with pytest.raises(DataValidationError, match=r"column 'reward_model' has type string, expected struct"):
        read_prompts(str(tmp_path / "c.parquet"))


def test_unreadable_empty_and_missing_inputs(tmp_path):
    corrupt = tmp_path / "corrupt.parquet"
    write_verl(corrupt, verl_rows(3))
    corrupt.write_bytes(corrupt.read_bytes()[:-20])  # truncated footer
    with pytest.raises(DataValidationError, match=r"corrupt\.parquet: cannot be read as parquet"):
        read_prompts(str(corrupt))

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([], schema=pa.Table.from_pylist(verl_rows(1)).schema), empty)
    with pytest.raises(DataValidationError, match=r"empty\.parquet: the dataset has no rows"):
        read_prompts(str(empty))

    with pytest.raises(DataValidationError, match="no such file"):
        read_prompts(str(tmp_path / "nope.parquet"))
    (tmp_path / "d").mkdir()
    with pytest.raises(DataValidationError, match=r"no \*\.parquet files"):
        read_prompts(str(tmp_path / "d"))
    with pytest.raises(DataValidationError, match="empty dataset path"):
        read_prompts("")


def test_base_dir_confines_paths(tmp_path):
    inside = tmp_path / "data"
    inside.mkdir()
    write_verl(inside / "t.parquet", verl_rows(1))
    write_verl(tmp_path / "outside.parquet", verl_rows(1))
    assert len(read_prompts(str(inside / "t.parquet"), base_dir=str(inside))) == 1
    assert len(read_prompts("t.parquet", base_dir=str(inside))) == 1  # relative to base_dir
    for escaping in (str(tmp_path / "outside.parquet"), "../outside.parquet", f"{inside}/../outside.parquet"):
        with pytest.raises(DataValidationError, match="outside data.base_dir"):
            read_prompts(escaping, base_dir=str(inside))
    os.symlink(tmp_path / "outside.parquet", inside / "link.parquet")
    with pytest.raises(DataValidationError, match="outside data.base_dir"):
        read_prompts(str(inside / "link.parquet"), base_dir=str(inside))


def test_failed_write_leaves_old_file_intact_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "train.parquet"
    write_parquet_atomic(flat_frame(2), str(path))
    before = path.read_bytes()

    def write_half_then_fail(table, where, **kwargs):
        with open(where, "wb") as f:
            f.write(b"PAR1 partial")
        raise OSError("disk full")

    monkeypatch.setattr(io.pq, "write_table", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_parquet_atomic(flat_frame(5), str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["train.parquet"]
    monkeypatch.undo()
    assert len(read_prompts(str(path))) == 2


def test_fsspec_object_store_paths():
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "memory://rlhf-test-bucket"
    try:
        write_parquet_atomic(flat_frame(2), f"{root}/data/a.parquet")
        with fs.open("/rlhf-test-bucket/data/b.parquet", "wb") as f:
            pq.write_table(pa.Table.from_pylist(verl_rows(3)), f)
        assert len(read_prompts(f"{root}/data/a.parquet")) == 2
        df = read_prompts(f"{root}/data", base_dir=f"{root}/data")
        assert df["data_source"].tolist() == ["synthetic/arithmetic"] * 2 + ["openai/gsm8k"] * 3
        with pytest.raises(DataValidationError, match="outside data.base_dir"):
            read_prompts(f"{root}/data/../a.parquet", base_dir=f"{root}/data")
        with pytest.raises(DataValidationError, match="same filesystem"):
            read_prompts("/tmp/x.parquet", base_dir=f"{root}/data")
        bad = flat_frame(2)
        bad.loc[1, "reward_style"] = "nope"
        write_parquet_atomic(bad, f"{root}/bad.parquet")
        with pytest.raises(DataValidationError, match=r"memory://.*bad\.parquet.*\n.*row 1"):
            read_prompts(f"{root}/bad.parquet")
    finally:
        fs.rm("/rlhf-test-bucket", recursive=True)
