"""Offline RLHF: a rollout table stored by one run's rollout stage trains another run with no
generation, with and without stored log-probs and scores; bad tables name row and column."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf.config import load_config
from rlhf.data.io import DataValidationError
from test_trainer import TINY

NO_VAL = ["trainer.test_freq=-1", "trainer.val_before_train=false"]
CHECKPOINT_TIMES = {"timing_s/save_checkpoint"}  # `Run.checkpoint` logs this each round (the wait: a step metric)


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> dict:
    """One online round of the tiny default, its scored rollouts written to `rollout_data_dir`."""
    from rlhf.train import train

    out = tmp_path_factory.mktemp("online")
    cfg = load_config(None, TINY + NO_VAL + [f"trainer.output_dir={out}", "trainer.total_rounds=1",
                                             "model.sft.max_steps=300", "rollout.temperature=1.0", "reward.format_score=0.1",
                                             f"trainer.rollout_data_dir={out / 'rollouts'}"])
    train(cfg)
    files = sorted((out / "rollouts").glob("*.parquet"))
    assert [f.name for f in files] == ["round_000001.parquet"]
    table = pd.read_parquet(files[0])
    assert 0 < table["score"].mean() < 1, "the stored round needs mixed scores for the checks below"
    return {"dir": str(out / "rollouts"), "base": str(out / "base_model"), "table": pd.read_parquet(files[0])}


@pytest.fixture
def no_engine(monkeypatch):
    """Any attempt to build a rollout engine fails the test."""
    import rlhf.rollout

    def refuse(*a, **k):
        raise AssertionError("a rollout engine was built in an offline run")

    monkeypatch.setattr(rlhf.rollout, "make_engine", refuse)


def _offline_run(tmp_path: Path, stored: dict, files: str, *extra: str):
    from rlhf.train import Run

    cfg = load_config(None, TINY + NO_VAL + [f"trainer.output_dir={tmp_path}", f"model.path={stored['base']}",
                                             f"data.rollout_files={files}", "trainer.total_rounds=2",
                                             "rollout.temperature=1.0", "reward.format_score=0.1", *extra])
    return Run(cfg)


def _recorded(run) -> list[dict]:
    """Every metrics dict the run logs from now on: each round's step metrics (and validation),
    then its checkpoint's times."""
    logged, log = [], run.sink.log_metrics
    run.sink.log_metrics = lambda m, step=None: (logged.append(dict(m)), log(m, step=step))
    return logged


def _params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_offline_stored_round_trains_another_run_without_generation(tmp_path, stored, no_engine):
    run = _offline_run(tmp_path, stored, stored["dir"])
    try:
        before = _params(run.trainer.actor.module)
        logged = _recorded(run)
        run.round()
        run.round()
        assert run._engine is None
        after = _params(run.trainer.actor.module)
        assert any(not torch.equal(before[k], after[k]) for k in before)
        first, first_checkpoint, second, second_checkpoint = logged
        assert set(first_checkpoint) == set(second_checkpoint) == CHECKPOINT_TIMES
        assert "timing_s/checkpoint_wait" in first and "timing_s/checkpoint_wait" in second
        assert first["critic/score/mean"] == pytest.approx(stored["table"]["score"].mean())  # stored scores used
        # The stored log-probs are the base policy's, which is this run's start: weights 1 in round 1.
        assert first["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
        assert first["rollout_corr/log_prob_abs_diff_max"] < 1e-3
        # Round 2 reuses the block after an update: the behaviour policy is no longer the current one.
        assert second["rollout_corr/log_prob_abs_diff_max"] > first["rollout_corr/log_prob_abs_diff_max"]
        assert all(torch.isfinite(torch.tensor(v)) for v in second.values())
    finally:
        run.close()


def test_offline_without_log_probs_ids_or_scores_is_tokenized_and_scored(tmp_path, stored, no_engine):
    """A verl-style table: nested reward_model, the response text only."""
    t = stored["table"]
    table = pa.table({
        "data_source": t["data_source"], "prompt": t["prompt"], "ability": t["ability"],
        "reward_model": [{"style": s, "ground_truth": g} for s, g in zip(t["reward_style"], t["ground_truth"])],
        "extra_info": [json.loads(x) or {"k": 0} for x in t["extra_info"]], "response": t["response"]})
    pq.write_table(table, tmp_path / "verl_style.parquet")
    run = _offline_run(tmp_path / "out", stored, str(tmp_path / "verl_style.parquet"), "trainer.total_rounds=1")
    try:
        assert json.loads(run.offline["response_ids"][0]) == json.loads(t["response_ids"][0])  # same tokens back
        assert "score" not in run.offline
        logged = _recorded(run)
        run.round()
        m, checkpoint = logged
        assert set(checkpoint) == CHECKPOINT_TIMES
        assert m["critic/score/mean"] == pytest.approx(t["score"].mean())  # re-scored by the reward rule
        assert not any(k.startswith("rollout_corr/") for k in m)  # behaviour policy unknown: no correction
        assert run._engine is None
    finally:
        run.close()


def test_offline_partial_scores_are_filled_in(stored):
    from rlhf.round.offline import score_missing

    cfg = load_config(None, TINY + ["reward.format_score=0.1"])
    rows = stored["table"].copy()
    truth = rows["score"].copy()
    rows.loc[[0, 3], "score"] = float("nan")
    rows.loc[1, "score"] = 0.25  # a stored score is kept even if the rule would say otherwise
    out = score_missing(rows, cfg)
    assert out["score"][0] == truth[0] and out["score"][3] == truth[3] and out["score"][1] == 0.25


def _write(df: pd.DataFrame, path: Path) -> str:
    df.to_parquet(path, index=False)
    return str(path)


def _load(path: str, **kw):
    from rlhf.data.rollouts import complete_rollouts, read_rollout_table
    from rlhf.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    stored = read_rollout_table(path)
    prompts = [tok(p)["input_ids"] for p in stored["prompt"]] if "prompt_ids" not in stored else None
    return complete_rollouts(stored, tok, 32, 16, kw.get("n", 2), prompts, source=path)


def test_offline_bad_tables_name_the_row_and_column(tmp_path, stored):
    t = stored["table"]
    with pytest.raises(DataValidationError, match="missing column 'response'"):
        _load(_write(t.drop(columns="response"), tmp_path / "a.parquet"))
    bad = t.copy()
    bad.loc[2, "rollout_logprobs"] = "[-0.5]"
    with pytest.raises(DataValidationError, match=r"rollout_logprobs.*row 2"):
        _load(_write(bad, tmp_path / "b.parquet"))
    bad = t.copy()
    bad.loc[5, "finish_reason"] = "eos"
    with pytest.raises(DataValidationError, match=r"finish_reason.*row 5: got 'eos'"):
        _load(_write(bad, tmp_path / "c.parquet"))
    bad = t.astype({"score": str})
    bad.loc[4, "score"] = "high"
    with pytest.raises(DataValidationError, match=r"rows 4: column 'score' holds 'high', not a number"):
        _load(_write(bad, tmp_path / "d.parquet"))
    with pytest.raises(DataValidationError, match=r"rows 0, 1: column 'group_id': group 0 has 2 responses.*rollout.n=3"):
        _load(_write(t, tmp_path / "e.parquet"), n=3)
    with pytest.raises(DataValidationError, match="'response_ids' is missing"):
        _load(_write(t.drop(columns="response_ids"), tmp_path / "f.parquet"))
    long = t.copy()
    long.loc[7, "response_ids"] = json.dumps(list(range(5, 30)))
    long.loc[7, "rollout_logprobs"] = "[]"
    with pytest.raises(DataValidationError, match=r"rows 7: column 'response_ids' holds 25 tokens.*max_response_length=16"):
        _load(_write(long, tmp_path / "g.parquet"))


def test_offline_table_too_small_for_a_round_says_what_to_change(tmp_path, stored):
    from rlhf.models.tokenizer import build_char_tokenizer
    from rlhf.round.offline import load_rollouts

    path = _write(stored["table"].iloc[:8], tmp_path / "small.parquet")
    cfg = load_config(None, TINY + [f"data.rollout_files={path}"])
    with pytest.raises(DataValidationError, match="8 stored responses, but a round needs 16"):
        load_rollouts(cfg, build_char_tokenizer())


def test_offline_rounds_walk_the_table_in_blocks(stored):
    from rlhf.round.offline import round_block

    cfg = load_config(None, TINY + ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4"])
    table = pd.concat([stored["table"]] * 2, ignore_index=True).assign(row=range(32))
    assert [round_block(table, cfg, r)["row"].iloc[0] for r in range(5)] == [0, 8, 16, 24, 0]


def test_offline_flyte_workflow_matches_the_in_process_driver(tmp_path, stored, no_engine, monkeypatch):
    """`ppo_offline` (flytekit local execution): the stored table replaces rollout and score,
    no engine is built, and its round is the in-process driver's round on the same table."""
    from rlhf.train import train
    from workflows.ppo import ppo_offline

    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")
    extra = TINY + NO_VAL + [f"model.path={stored['base']}", "trainer.total_rounds=1", "rollout.temperature=1.0",
                             "reward.format_score=0.1"]
    summary = train(load_config(None, extra + [f"trainer.output_dir={tmp_path / 'loop'}",
                                               f"data.rollout_files={stored['dir']}"]))
    out = ppo_offline(cfg=load_config(None, extra + [f"trainer.output_dir={tmp_path / 'flyte'}"]),
                      rollout_files=stored["dir"])
    assert out.state.global_step == summary["global_steps"] == 1
    assert summary["val_history"] == [] and out.state.val_history == []  # no validation anywhere
    from rlhf.checkpoint.rounds import latest_checkpoint
    from rlhf.round.state import RoundState

    loop_state = RoundState.from_json((latest_checkpoint(tmp_path / "loop") / "state.json").read_text())
    pd.testing.assert_frame_equal(pd.DataFrame(out.state.step_history), pd.DataFrame(loop_state.step_history),
                                  check_like=True, rtol=1e-4, atol=1e-6)


def test_offline_workflow_without_rollout_files_fails_before_any_work():
    from rlhf.config import ConfigError
    from workflows.ppo import ppo_offline

    with pytest.raises(ConfigError, match="ppo_offline needs stored rollouts"):
        ppo_offline(cfg=load_config(None, TINY))
