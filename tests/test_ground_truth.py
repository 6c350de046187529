"""Ground truths read in one text form from the flat and the verl layout, so that the rule
rewards (string comparison, as verl's) score them; a missing one (None, NaN) refused or
dropped and counted, never scored; and a first round that scores nothing warned about."""

from __future__ import annotations

import logging
import math

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.config import load_config
from rlhf.data.io import DataValidationError, read_prompts
from rlhf.rewards.gsm8k import compute_score
from test_data_io import flat_frame, verl_rows

ANSWERS = [86.0, -3.0, 0.5]  # what pandas writes for an integer column that held a missing value, and a fraction


def _verl_file(path, truths) -> str:
    rows = verl_rows(len(truths))
    for row, truth in zip(rows, truths):
        row["reward_model"]["ground_truth"] = truth
    pq.write_table(pa.Table.from_pylist(rows), path)  # the column is double (float64), nulls where None
    return str(path)


def _flat_file(path, truths) -> str:
    df = flat_frame(len(truths))
    df["ground_truth"] = pd.Series(truths, dtype="float64")
    df.to_parquet(path)
    return str(path)


def test_numbers_read_as_the_text_a_rule_compares_in_both_layouts(tmp_path):
    """86.0 is "86" in either layout (before: "86.0" from the verl layout, so `#### 86` scored
    0, and the flat layout refused the column)."""
    verl = read_prompts(_verl_file(tmp_path / "verl.parquet", ANSWERS))
    flat = read_prompts(_flat_file(tmp_path / "flat.parquet", ANSWERS))
    assert verl["ground_truth"].tolist() == flat["ground_truth"].tolist() == ["86", "-3", "0.5"]
    assert compute_score("so the answer is\n#### 86", verl.loc[0, "ground_truth"]) == 1.0
    assert compute_score("#### -3", flat.loc[1, "ground_truth"]) == 1.0


@pytest.mark.parametrize("layout", ["verl", "flat"])
def test_a_missing_ground_truth_is_refused_naming_the_row_or_dropped_and_counted(tmp_path, layout):
    """NaN (a float column) and None are a missing ground truth: a rule-scored row without one
    is named (before: the verl layout scored it against the text "nan")."""
    truths = [86.0, math.nan, None, 7.0]
    path = (_verl_file if layout == "verl" else _flat_file)(tmp_path / f"{layout}.parquet", truths)
    missing = r"column 'ground_truth', expected ground_truth set \(not null\) when reward_style is rule: row 1: got \w+; row 2"
    with pytest.raises(DataValidationError, match=missing):
        read_prompts(path)
    kept = read_prompts(path, drop_invalid=True)
    assert kept.attrs["n_dropped"] == 2 and kept["ground_truth"].tolist() == ["86", "7"]


# -- a first round with no reward at all --------------------------------------------------------------


def test_a_first_round_that_scores_nothing_is_warned_about_with_three_examples(tmp_path, caplog):
    """Ground truths present, every response of round 1 scored exactly 0 (here the answers are
    stored as "N.0" text, which no `#### N` matches): one warning with the tails of three
    prompts and responses and their ground truths; not for later rounds, nor once a response
    scores."""
    from rlhf.round import rules, stages
    from rlhf.train import stateless as P
    from test_trainer import TINY

    cfg = load_config(None, TINY + [f"trainer.output_dir={tmp_path}"])
    prompts = P.prepare_dataset(cfg.data).train.head(cfg.data.train_batch_size)
    responses = [f"adding them up gives {g}\n#### {g}" for g in prompts["ground_truth"]]
    right = stages.score(prompts.assign(response=responses), cfg)
    assert (right["score"] == 1.0).all()
    scored = stages.score(prompts.assign(response=responses, ground_truth=prompts["ground_truth"] + ".0"), cfg)
    assert (scored["score"] == 0).all()
    with caplog.at_level(logging.WARNING, logger="rlhf.train"):
        message = rules.warn_if_unrewarded(scored, 1)
        assert rules.warn_if_unrewarded(scored, 2) == "" and rules.warn_if_unrewarded(right, 1) == ""
    assert message and caplog.text.count("scored exactly 0") == 1
    assert message.count("  prompt ...") == 3 and message.count("  response ...") == 3
    first = scored.iloc[0]
    assert f"ground truth {first.ground_truth!r}" in message and repr(first.response[-80:]) in message
