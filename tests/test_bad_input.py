"""Bad input refused before any work, with a message naming the file, row, column or key and
what to do: text that is not UTF-8, config files that cannot be a config, data sources without
a reward function, and a validation set that misses a source the run trains on. (Corrupt
parquet, wrong column types, overlong prompts, empty datasets and batch sizes that do not
divide are covered in test_data_io.py, test_data_sampling.py and test_config.py.)"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.config import ConfigError, load_config
from rlhf.data.io import DataValidationError, read_prompts
from rlhf.round.stages import prepare_data


def _table(prompts: pa.Array, sources: list[str] | None = None) -> pa.Table:
    n = len(prompts)
    return pa.table({"prompt": prompts, "data_source": sources or ["synthetic/arithmetic"] * n,
                     "ability": ["math"] * n, "reward_style": ["rule"] * n,
                     "ground_truth": [str(i) for i in range(n)], "extra_info": ["{}"] * n})


def test_text_that_is_not_utf8_names_the_file_column_and_row(tmp_path):
    # pyarrow writes a string column's bytes as given; a file made by another tool may hold latin-1.
    prompts = pa.array([b"1+1=", b"caf\xe9 2+2=", b"3+3="], pa.binary()).view(pa.string())
    path = tmp_path / "latin1.parquet"
    pq.write_table(_table(prompts), path)
    with pytest.raises(DataValidationError, match=r"latin1\.parquet: column 'prompt', row 1, holds bytes that are "
                                                  r"not valid UTF-8.*decode the source text with its real encoding"):
        read_prompts(str(path))


def _config(tmp_path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_config_files_that_cannot_be_a_config_name_the_file(tmp_path):
    cases = {
        "latin1.yaml": (b"trainer: {experiment_name: caf\xe9}\n", "is not UTF-8 text.*save it as UTF-8"),
        "deep.json": (b"[" * 5000 + b"]" * 5000, "nests lists or mappings too deeply"),
        "loop.yaml": (b"data: &d {synthetic: *d}\n", "'data.synthetic' refers to itself"),
        "bomb.yaml": (b"a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                      b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
                      b"d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n", "repeats YAML aliases"),
        "set.yaml": (b"trainer: {logger: !!set {console}}\n", "'trainer.logger' holds a set"),
        "nan.yaml": (b"actor: {entropy_coeff: .nan}\n", "'actor.entropy_coeff' is NaN"),
    }
    for name, (data, message) in cases.items():
        path = _config(tmp_path, name, data)
        with pytest.raises(ConfigError, match=message) as e:
            load_config(path)
        assert path in str(e.value), name


def test_unquoted_dates_in_a_config_are_read_as_text(tmp_path):
    path = _config(tmp_path, "date.yaml", b"trainer: {experiment_name: 2024-01-31}\n")
    assert load_config(path, ["trainer.project_name=2024-02-01"]).trainer.experiment_name == "2024-01-31"
    assert load_config(path, ["trainer.project_name=2024-02-01"]).trainer.project_name == "2024-02-01"
    with pytest.raises(ConfigError, match="'rollout.n' expects int, got '2024-02-01'"):
        load_config(None, ["rollout.n=2024-02-01"])


def _files(tmp_path, train_sources: list[str], val_sources: list[str], style: str = "rule") -> list[str]:
    for name, sources in (("train", train_sources), ("val", val_sources)):
        table = _table(pa.array([f"{i}+1=" for i in range(len(sources))]), sources)
        pq.write_table(table.set_column(3, "reward_style", pa.array([style] * len(sources))),
                       tmp_path / f"{name}.parquet")
    return [f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/val.parquet"]


def test_unknown_data_source_is_refused_before_training(tmp_path):
    sources = ["synthetic/arithmetic", "my/source", "synthetic/arithmetic", "my/source"]
    cfg = load_config(None, _files(tmp_path, sources, sources))
    with pytest.raises(DataValidationError, match=r"train\.parquet: data_source 'my/source' \(rows 1, 3\) has no "
                                                  r"reward function; known: .*REWARDS\.add\('my/source', fn\)"):
        prepare_data(cfg)
    model_scored = load_config(None, _files(tmp_path, sources, sources, style="model"))
    assert len(prepare_data(model_scored).train) == 4  # a reward model scores any source


def test_val_set_without_rows_for_a_trained_source_is_refused(tmp_path):
    cfg = load_config(None, _files(tmp_path, ["synthetic/arithmetic", "openai/gsm8k"], ["synthetic/arithmetic"]))
    with pytest.raises(DataValidationError, match=r"val\.parquet: no validation rows for data_source\(s\) "
                                                  r"'openai/gsm8k', which .*train\.parquet trains on; add rows"):
        prepare_data(cfg)
    fine = load_config(None, _files(tmp_path, ["synthetic/arithmetic"], ["synthetic/arithmetic", "openai/gsm8k"]))
    assert len(prepare_data(fine).val) == 2  # extra validation sources are allowed


def test_overlong_prompts_are_dropped_and_counted_before_training(tok, caplog):
    import pandas as pd

    from rlhf.round.stages import DataBundle, fit_data, fit_prompts

    df = pd.DataFrame({"prompt": ["1+1=", "12345678901234567890+1=", "2+2="], "data_source": "synthetic/arithmetic",
                       "ground_truth": ["2", "0", "4"]})
    cfg = load_config(None, ["data.max_prompt_length=10"])
    with caplog.at_level("WARNING"):
        fitted = fit_data(DataBundle(train=df, val=df.iloc[[0]], sft=None), tok, cfg)
    assert fitted.train["prompt"].tolist() == ["1+1=", "2+2="] and len(fitted.val) == 1
    assert "dropped 1 of 3 train prompts longer than data.max_prompt_length=10" in caplog.text
    kept = fit_prompts(df, tok, load_config(None, ["data.max_prompt_length=10", "data.filter_overlong_prompts=false"]),
                       "train")
    assert len(kept) == 3  # data.truncation decides at rollout instead
    with pytest.raises(ValueError, match="every one of the 1 val prompts is longer than data.max_prompt_length=3"):
        fit_prompts(df.iloc[[1]], tok, load_config(None, ["data.max_prompt_length=3"]), "val")
