"""GSM8K preprocessing: verl's row semantics, from local files, through the CLI."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.data.gsm8k import INSTRUCTION, extract_solution, main
from rlhf.data.io import DataValidationError, read_prompts
from schemas import PromptSchema

RECORDS = {
    "train": [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A car costs $1,250 more than $1,000. Price?", "answer": "1000 + 1250 = 2250\n#### 2,250"},
        {"question": "Temperature drops 5 below 0?", "answer": "It is -5.\n#### -5"},
    ],
    "test": [{"question": "Half of 9?", "answer": "9 / 2 = 4.5\n#### 4.5"}],
}


def write_jsonl(directory, split, records):
    with open(os.path.join(directory, f"{split}.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_extract_solution_follows_verl():
    assert extract_solution("blah\n#### 1,234") == "1234"
    assert extract_solution("#### -3.5 dollars") == "-3.5"
    assert extract_solution("#### 7\nlater #### 8") == "7"
    assert extract_solution("no final answer") is None
    assert extract_solution("####7") is None  # verl requires the space


def test_cli_writes_verl_nested_layout(tmp_path):
    src, out = tmp_path / "raw", tmp_path / "out"
    src.mkdir()
    for split, records in RECORDS.items():
        write_jsonl(src, split, records)
    assert main(["--input", str(src), "--output", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["test.parquet", "train.parquet"]

    table = pq.read_table(out / "train.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert pa.types.is_list(table.schema.field("prompt").type)
    rows = table.to_pylist()
    assert rows[1]["prompt"] == [{"role": "user", "content": RECORDS["train"][1]["question"] + " " + INSTRUCTION}]
    assert [r["reward_model"] for r in rows] == [{"style": "rule", "ground_truth": g} for g in ("7", "2250", "-5")]
    assert rows[2]["extra_info"] == {"split": "train", "index": 2, "answer": RECORDS["train"][2]["answer"],
                                     "question": RECORDS["train"][2]["question"]}
    assert {r["data_source"] for r in rows} == {"openai/gsm8k"} and {r["ability"] for r in rows} == {"math"}
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'

    df = read_prompts(str(out / "train.parquet"))
    PromptSchema.validate(df)
    assert df["ground_truth"].tolist() == ["7", "2250", "-5"]
    assert json.loads(df.loc[0, "prompt"])[0]["content"].endswith(INSTRUCTION)
    assert read_prompts(str(out / "test.parquet"))["ground_truth"].tolist() == ["4.5"]


def test_flat_option_and_hub_parquet_layout(tmp_path):
    src, out = tmp_path / "raw", tmp_path / "out"
    (src / "main").mkdir(parents=True)
    for split, records in RECORDS.items():
        pq.write_table(pa.Table.from_pylist(records), src / "main" / f"{split}-00000-of-00001.parquet")
    assert main(["--input", str(src), "--output", str(out), "--flat", "--prompt-format", "text"]) == 0
    flat = pq.read_table(out / "train.parquet")
    assert flat.column_names == list(PromptSchema.to_schema().columns)
    df = read_prompts(str(out / "train.parquet"))
    assert df.loc[0, "prompt"] == RECORDS["train"][0]["question"] + " " + INSTRUCTION
    assert df["reward_style"].tolist() == ["rule"] * 3 and df["ground_truth"].tolist() == ["7", "2250", "-5"]


def test_answer_without_final_number_is_reported(tmp_path, capsys):
    src = tmp_path / "raw"
    src.mkdir()
    write_jsonl(src, "train", RECORDS["train"] + [{"question": "q", "answer": "no marker"}])
    write_jsonl(src, "test", RECORDS["test"])
    assert main(["--input", str(src), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl: row 3 column 'answer'" in err and "####" in err
    assert not (tmp_path / "out" / "train.parquet").exists()
    with pytest.raises(DataValidationError, match="no GSM8K 'validation' file"):
        from rlhf.data.gsm8k import find_split_files
        find_split_files(str(src), "validation")


def test_module_runs_as_a_script(tmp_path):
    src, out = tmp_path / "raw", tmp_path / "out"
    src.mkdir()
    write_jsonl(src, "train", RECORDS["train"])
    proc = subprocess.run([sys.executable, "-m", "rlhf.data.gsm8k", "--input", str(src), "--output", str(out),
                           "--splits", "train"], capture_output=True, text=True, cwd=os.getcwd(),
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 0, proc.stderr
    assert "wrote 3 rows" in proc.stdout
    assert len(read_prompts(str(out / "train.parquet"))) == 3
