"""`trainer.balance_batch`: each PPO mini-batch split over data-parallel ranks by equal rows
and near-equal tokens (`stages.shard_for_update`)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from rlhf.round import stages
from rlhf.config import derive_sizes, load_config
from rlhf.data.batching import equal_count_partition

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*overrides: str):
    return load_config(None, ["data.train_batch_size=32", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                              "actor.ppo_micro_batch_size_per_gpu=4", "trainer.steps_per_round=2", *overrides])


def _table(cfg, seed: int = 0) -> pd.DataFrame:
    """A scored table of the config's round size with a skewed length spread: log-normal
    prompts (shared by a prompt's responses) and log-normal responses with a long tail."""
    rng = np.random.default_rng(seed)
    n_prompts = cfg.data.train_batch_size * cfg.trainer.steps_per_round
    n = cfg.rollout.n
    p_len = np.repeat(np.clip(rng.lognormal(np.log(200), 0.5, n_prompts), 16, 512).astype(int), n)
    r_len = np.clip(rng.lognormal(np.log(180), 0.75, n_prompts * n), 32, 512).astype(int)
    return pd.DataFrame({
        "prompt_ids": [json.dumps([1] * int(k)) for k in p_len],
        "response_ids": [json.dumps([2] * int(k)) for k in r_len],
        "group_id": np.repeat(np.arange(n_prompts), n).astype(np.int64),
        "row": np.arange(n_prompts * n),
    })


def _shares(df, cfg, world) -> list[list[int]]:
    return [stages.shard_for_update(df, cfg, r, world)["row"].tolist() for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_every_row_once_and_each_rank_mini_batch_is_its_part_of_one_global_mini_batch(world):
    cfg = _cfg()
    df = _table(cfg)
    shares = _shares(df, cfg, world)
    rows = [i for s in shares for i in s]
    assert sorted(rows) == list(range(len(df)))  # every row on exactly one rank, once
    sizes = derive_sizes(cfg, world)
    m, chunk = sizes.mini_batch_per_gpu, sizes.mini_batch_responses
    assert {len(s) for s in shares} == {len(df) // world}
    for s in shares:
        minis = [s[k:k + m] for k in range(0, len(s), m)]
        assert len(minis) == len(df) // chunk
        for i, mini in enumerate(minis):  # rank's i-th mini-batch: inside global mini-batch i, in row order
            assert all(i * chunk <= r < (i + 1) * chunk for r in mini), (i, mini)
            assert mini == sorted(mini)


def test_balanced_split_evens_tokens_where_the_contiguous_one_does_not():
    cfg = _cfg()
    df = _table(cfg)
    lengths = stages.token_lengths(df)
    m = derive_sizes(cfg, 2).mini_batch_per_gpu
    contiguous = [stages.shard(df, cfg.trainer.steps_per_round, r, 2)["row"].tolist() for r in range(2)]
    balanced = _shares(df, cfg, 2)
    worst_contiguous = stages.rank_token_imbalance(lengths, contiguous, m)
    worst_balanced = stages.rank_token_imbalance(lengths, balanced, m)
    assert worst_contiguous > 1.1, "the length spread is not skewed enough to test anything"
    assert worst_balanced < 1.002, (worst_balanced, worst_contiguous)


def test_grpo_keeps_every_prompt_group_on_one_rank():
    cfg = _cfg("algorithm.adv_estimator=grpo")
    df = _table(cfg)
    lengths = stages.token_lengths(df)
    shares = _shares(df, cfg, 2)
    owner = {}
    for r, s in enumerate(shares):
        for i in s:
            assert owner.setdefault(int(df["group_id"][i]), r) == r, f"group {df['group_id'][i]} split"
    assert sorted(i for s in shares for i in s) == list(range(len(df)))
    for s in shares:  # a group's rows stay together and in order on its rank
        ids = df["group_id"].to_numpy()[s]
        assert all((ids[k:k + cfg.rollout.n] == ids[k]).all() for k in range(0, len(ids), cfg.rollout.n))
    m = derive_sizes(cfg, 2).mini_batch_per_gpu
    contiguous = [stages.shard(df, cfg.trainer.steps_per_round, r, 2)["row"].tolist() for r in range(2)]
    assert stages.rank_token_imbalance(lengths, shares, m) < 1.02
    assert stages.rank_token_imbalance(lengths, contiguous, m) > 1.1


def test_groups_that_do_not_divide_a_mini_batch_are_balanced_over_the_whole_step():
    # 3 prompt groups per mini-batch cannot go to 2 ranks; the step's 6 can.
    cfg = load_config(None, ["data.train_batch_size=6", "rollout.n=2", "actor.ppo_mini_batch_size=3",
                             "actor.ppo_micro_batch_size_per_gpu=3", "algorithm.adv_estimator=grpo"])
    df = _table(cfg, seed=3)
    shares = _shares(df, cfg, 2)
    assert [len(s) for s in shares] == [6, 6]
    groups = [set(df["group_id"].to_numpy()[s].tolist()) for s in shares]
    assert len(groups[0]) == len(groups[1]) == 3 and not groups[0] & groups[1]
    lengths = stages.token_lengths(df)
    units = [sum(lengths[2 * g:2 * g + 2]) for g in range(6)]
    expected = equal_count_partition(units, 2)
    assert [sorted(g) for g in groups] == expected


def test_falls_back_to_the_contiguous_split_and_says_why_once(monkeypatch, caplog):
    # 3 prompt groups in the whole step: no equal split over 2 ranks keeps groups whole.
    cfg = load_config(None, ["data.train_batch_size=3", "rollout.n=2", "actor.ppo_mini_batch_size=3",
                             "actor.ppo_micro_batch_size_per_gpu=3", "algorithm.adv_estimator=grpo"])
    df = _table(cfg)
    monkeypatch.setattr(stages, "_FALLBACK_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="rlhf.round.stages"):
        for r in range(2):
            got = stages.shard_for_update(df, cfg, r, 2)
            pd.testing.assert_frame_equal(got, stages.shard(df, 1, r, 2))
    notes = [rec.getMessage() for rec in caplog.records if "balance_batch" in rec.getMessage()]
    assert len(notes) == 1 and "3 prompt groups" in notes[0], notes
    assert stages.balanced_rows([1] * 7, 2, 2, 2) == (None, "7 rows do not make 2 equal step blocks")


def test_balance_off_or_one_rank_is_the_contiguous_split():
    cfg = _cfg("trainer.balance_batch=false")
    df = _table(cfg)
    for r in range(2):
        pd.testing.assert_frame_equal(stages.shard_for_update(df, cfg, r, 2), stages.shard(df, 2, r, 2))
    pd.testing.assert_frame_equal(stages.shard_for_update(df, _cfg(), 0, 1), df)
    assert _cfg().trainer.balance_batch is True


def test_every_process_computes_the_same_partition():
    """Another interpreter (another hash seed) on a copy of the table gets the same shares."""
    cfg = _cfg("algorithm.adv_estimator=grpo")
    df = _table(cfg, seed=5)
    here = [_shares(df, c, 2) for c in (cfg, _cfg())]
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_balance_batch import _cfg, _table, _shares; "
            "c = _cfg('algorithm.adv_estimator=grpo'); df = _table(c, seed=5).copy(deep=True); "
            "print(json.dumps([_shares(df, c, 2), _shares(df, _cfg(), 2)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_step_major_rebuilds_the_global_order_the_contiguous_split_came_from():
    """Each rank's own rows (its `steps` blocks in turn) gathered in step-major order: the
    contiguous split of that table gives every rank back exactly its rows; group ids of
    different ranks never collide."""
    world, steps, per = 2, 3, 4
    frames = [pd.DataFrame({"row": [f"r{r}s{s}i{i}" for s in range(steps) for i in range(per)],
                            "group_id": np.repeat(np.arange(steps * per // 2), 2).astype(np.int64)})
              for r in range(world)]
    table = stages.step_major(frames, steps)
    assert table["row"].tolist()[:2 * per] == [f"r{r}s0i{i}" for r in range(world) for i in range(per)]
    for r in range(world):
        assert stages.shard(table, steps, r, world)["row"].tolist() == frames[r]["row"].tolist()
    ids = table.groupby("group_id")["row"].apply(lambda x: {v[:2] for v in x})
    assert all(len(v) == 1 for v in ids)  # no id shared by two ranks
    assert table["group_id"].nunique() == world * steps * per // 2


@pytest.mark.parametrize("k", [2, 3, 8])
def test_equal_count_partition(k):
    rng = np.random.default_rng(k)
    lengths = np.clip(rng.lognormal(np.log(300), 0.8, 24 * k), 10, 2000).astype(int).tolist()
    parts = equal_count_partition(lengths, k)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert {len(p) for p in parts} == {24} and all(p == sorted(p) for p in parts)
    totals = [sum(lengths[i] for i in p) for p in parts]
    assert max(totals) - min(totals) <= max(lengths) // 10, totals
    assert equal_count_partition(lengths, k) == parts
    with pytest.raises(ValueError, match="equal count"):
        equal_count_partition(lengths[:-1], k)


@pytest.mark.slow
def test_two_ranks_balanced_train_on_the_global_mini_batches_of_one_rank(tmp_path):
    """torchrun, 2 gloo ranks, 2 mini-batches per step, balance on: the ranks' rows are the
    scored rows, each once, and each rank mini-batch lies inside the matching mini-batch of
    one process, so the weights equal one process's on the same buffer (the contiguous split
    would pair rows of different one-process mini-batches)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_trainer import _clean_env, _free_port

    script, args = ROOT / "tests" / "dp_update.py", ["actor.ppo_mini_batch_size=4", "trainer.balance_batch=true"]
    env = _clean_env()
    single = subprocess.run([sys.executable, str(script), str(tmp_path / "one"), *args], env=env,
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    double = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--rdzv-endpoint=127.0.0.1:{_free_port()}", str(script), str(tmp_path / "two"), *args],
                            env=env, capture_output=True, text=True, timeout=600)
    assert double.returncode == 0, double.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    r0, r1 = (json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in range(2))
    assert sorted(r0["rows"] + r1["rows"]) == sorted(one["rows"]) == list(range(16))
    for ranks_rows in (r0["rows"], r1["rows"]):
        assert len(ranks_rows) == 8
        assert all(r < 8 for r in ranks_rows[:4]) and all(r >= 8 for r in ranks_rows[4:])
    assert r0["checksum"] == r1["checksum"], "ranks diverged"
    assert r0["checksum"] == pytest.approx(one["checksum"], rel=1e-5)
    assert r0["pg_loss"] == pytest.approx(one["pg_loss"], abs=1e-4)
    assert r0["max_param_diff_vs_start"] > 0
