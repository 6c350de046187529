"""The stateless stage runners (`rlhf.train.stateless`), and the design promise "two drivers, one
round": the in-process loop and the Flyte workflow give the same rounds on one config."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from rlhf.train import stateless as P
from rlhf.config import load_config
from rlhf.round.state import RoundState
from test_trainer import TINY

# Adaptive KL with a low target and an entropy bonus: the policy, the critic and the KL
# coefficient all move in every step, so any difference between the drivers shows.
MOVING = ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.target_kl=0.001",
          "algorithm.kl_ctrl.horizon=50", "early_stop.enable=false", "actor.entropy_coeff=0.05", "actor.lr=5e-3"]


@pytest.fixture(autouse=True)
def _no_flyte_cache(monkeypatch):
    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """The tiny SFT-warm-started policy, built once and shared as `model.path`."""
    cfg = load_config(None, TINY)
    data = P.prepare_dataset(cfg.data)
    return P.prepare_base_model(cfg.model, cfg.trainer.seed, data.sft, str(tmp_path_factory.mktemp("base") / "m"))


def cfg_for(out: Path, base: str, *extra: str):
    return load_config(None, TINY + MOVING + [f"trainer.output_dir={out}", f"model.path={base}", *extra])


# -- rules shared by both drivers -----------------------------------------------------------


def test_evaluation_schedule():
    cfg = load_config(None, ["trainer.total_rounds=5", "trainer.test_freq=2"])
    assert [r for r in range(1, 6) if P.should_evaluate(cfg, r)] == [2, 4, 5]
    assert P.should_validate_first(cfg, RoundState.initial(cfg))
    assert not P.should_validate_first(cfg, RoundState(round=1))
    assert not P.should_validate_first(load_config(None, ["trainer.val_before_train=false"]), RoundState())


def test_record_update_moves_round_step_and_kl():
    s = P.record_update(RoundState(round=2, global_step=4), [{"actor/pg_loss": 1.0}, {"actor/pg_loss": 2.0}], 0.3)
    assert (s.round, s.global_step, s.kl_coef) == (3, 6, 0.3)
    assert [h["step"] for h in s.step_history] == [5.0, 6.0]


def test_rollout_seed_differs_by_round_and_rank():
    cfg = load_config(None, [])
    seeds = {P.rollout_seed(cfg, r, k) for r in range(4) for k in range(4)}
    assert len(seeds) == 16


def test_metrics_table_merges_steps_and_validation():
    state = RoundState(step_history=[{"step": 1.0, "actor/pg_loss": 0.5}, {"step": 2.0, "actor/pg_loss": 0.25}],
                       val_history=[{"round": 0.0, "step": 0.0, "score": 0.1},
                                    {"round": 2.0, "step": 2.0, "score": 0.4}])
    table = P.metrics_table(state)
    assert table["step"].tolist() == [0, 1, 2]
    assert table["val/score"].tolist()[0] == 0.1 and math.isnan(table["val/score"][1])
    assert table["val/score"][2] == 0.4 and table["actor/pg_loss"][2] == 0.25
    empty = P.metrics_table(RoundState())
    assert len(empty) == 0 and "val/score" in empty


def test_dataset_fingerprint_follows_the_files(tmp_path):
    from rlhf.config import DataConfig
    from rlhf.data.arithmetic import make_arithmetic

    assert P.dataset_fingerprint(DataConfig()) == ""
    train, val = tmp_path / "train.parquet", tmp_path / "val.parquet"
    make_arithmetic(8, seed=1).to_parquet(train)
    make_arithmetic(4, seed=2).to_parquet(val)
    data = DataConfig(train_files=[str(train)], val_files=[str(val)])
    first = P.dataset_fingerprint(data)
    assert first and P.dataset_fingerprint(data) == first
    make_arithmetic(9, seed=1).to_parquet(train)
    os.utime(train, (1, 1))
    assert P.dataset_fingerprint(data) != first


# -- one round through the stateless runners ------------------------------------------------


def test_update_from_checkpoint_chains_rounds(base_model, tmp_path):
    """Round 1 from the base policy, round 2 from round 1's checkpoint: new checkpoints,
    state carried, optimizer state restored (the second update differs from a fresh one)."""
    from safetensors.torch import load_file

    cfg = cfg_for(tmp_path, base_model, f"trainer.rollout_data_dir={tmp_path / 'rows'}")
    data = P.prepare_dataset(cfg.data)
    state = RoundState.initial(cfg)
    checkpoint = None
    policy = base_model
    for r in range(2):
        from rlhf.round import stages

        prompts, state = stages.sample_prompts(data.train, state, cfg)
        rollouts, gen = P.rollout_policy(cfg, policy, prompts, state)
        scored, timing = P.score_timed(cfg, rollouts, P.gen_timing(gen))
        res = P.update_from_checkpoint(cfg, base_model, checkpoint, scored, state, str(tmp_path / f"u{r}"),
                                       timing=timing)
        assert Path(res.checkpoint).name == f"round_00000{r + 1}"
        assert res.state.round == r + 1 and res.state.global_step == r + 1
        assert len(res.steps) == 1 and "perf/throughput" in res.steps[0] and gen["timing_s/gen"] > 0
        # the stage driver stores the scored rollouts and logs the generation's timings, as the others do
        assert res.rollouts_path == str(tmp_path / "rows" / f"round_00000{r + 1}.parquet")
        pd.testing.assert_frame_equal(pd.read_parquet(res.rollouts_path), scored, check_like=True)
        assert res.steps[0]["timing_s/gen"] == gen["timing_s/gen"] and res.steps[0]["timing_s/reward"] > 0
        assert res.state.kl_coef != state.kl_coef, "the adaptive KL coefficient did not move"
        state, checkpoint, policy = res.state, res.checkpoint, res.policy
    before, after = load_file(f"{base_model}/model.safetensors"), load_file(f"{policy}/model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    evaluated, metrics = P.evaluate_policy(cfg, policy, data.val, state)
    assert evaluated.val_history[-1]["step"] == 2.0 and "val/accuracy" in metrics


# -- one round, three compositions ----------------------------------------------------------


@pytest.mark.slow
def test_in_process_staged_and_colocated_give_the_same_rounds(base_model, tmp_path, monkeypatch):
    """The in-process loop, the Flyte workflow with a task per stage, and the workflow with
    colocated segments (two rounds each: a validation inside a segment and one between
    segments, a segment boundary, intratask checkpoints) on one config and seed: the same
    rounds, and the same side effects (the metric keys logged at each step, the stored
    rollouts, each checkpoint's files, the run's artifacts)."""
    from safetensors.torch import load_file

    from rlhf.checkpoint.rounds import latest_checkpoint
    from rlhf.train import train
    from workflows.ppo import ppo_pipeline

    logged = _record_metric_keys(monkeypatch)
    # verl's trainer.total_epochs: two passes over 16 train prompts at 8 a round are 4 rounds,
    # which each driver works out once it has the train set.
    extra = ["trainer.total_epochs=2", "data.synthetic.n_train=16", "trainer.test_freq=1",
             "trainer.rounds_per_segment=2"]
    summary = train(cfg_for(tmp_path / "loop", base_model, *extra, f"trainer.rollout_data_dir={tmp_path}/loop_rows"))
    loop_ckpt = latest_checkpoint(tmp_path / "loop")
    loop_state = RoundState.from_json((loop_ckpt / "state.json").read_text())
    loop_weights = load_file(str(loop_ckpt / "actor" / "model.safetensors"))
    loop_side = _side_effects(tmp_path / "loop", tmp_path / "loop_rows", sorted(loop_ckpt.parent.glob("round_*")),
                              logged.pop("run"))
    assert loop_state.kl_coef != pytest.approx(0.05), "the KL coefficient never moved; the comparison would be weak"
    for granularity in ("stage", "segment"):
        flyte = ppo_pipeline(cfg=cfg_for(tmp_path / granularity, base_model, *extra,
                                         f"trainer.granularity={granularity}",
                                         f"trainer.rollout_data_dir={tmp_path}/{granularity}_rows"))
        s = flyte.state
        assert (s.round, s.global_step) == (summary["rounds"], summary["global_steps"]) == (4, 4), granularity
        assert [v["step"] for v in s.val_history] == [v["step"] for v in summary["val_history"]] == [0, 1, 2, 3, 4]
        assert [v["score"] for v in s.val_history] == pytest.approx([v["score"] for v in summary["val_history"]])
        assert s.kl_coef == pytest.approx(summary["kl_coef"], rel=1e-6), granularity
        pd.testing.assert_frame_equal(pd.DataFrame(s.step_history), pd.DataFrame(loop_state.step_history),
                                      check_like=True, rtol=1e-4, atol=1e-6)
        assert flyte.metrics["step"].tolist() == [0, 1, 2, 3, 4]
        b = load_file(os.path.join(flyte.model.download(), "model.safetensors"))
        assert loop_weights.keys() == b.keys()
        for k in loop_weights:
            torch.testing.assert_close(b[k], loop_weights[k], rtol=0, atol=1e-5, msg=f"{granularity}: {k}")
        side = _side_effects(tmp_path / granularity, tmp_path / f"{granularity}_rows",
                             [Path(c) for c in s.checkpoints], logged.pop("run"))
        _same_side_effects(loop_side, side, granularity)


def _record_metric_keys(monkeypatch) -> dict[str, dict[int, set[str]]]:
    """The metric keys every sink of the drivers logs, by step (`trainer.logger=[none]`: the
    sinks are `NullSink`s), under "run" until popped."""
    from collections import defaultdict

    from rlhf.tracking.sinks import NullSink

    logged: dict = defaultdict(lambda: defaultdict(set))

    def log_metrics(self, metrics, step):
        logged["run"][int(step)].update(metrics)

    monkeypatch.setattr(NullSink, "log_metrics", log_metrics)
    return logged


def _side_effects(out: Path, rows: Path, checkpoints: list[Path], keys: dict[int, set[str]]) -> dict:
    """What a driver left besides its rounds: the metric keys of each step, the stored scored
    rollouts, the file list of each checkpoint, the artifacts under the output directory."""
    files = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())  # noqa: E731
    assert checkpoints, out
    return {"keys": {step: sorted(k) for step, k in keys.items()},
            "rows": {p.name: pd.read_parquet(p) for p in sorted(rows.glob("*.parquet"))},
            "checkpoints": {tuple(files(c)) for c in checkpoints},
            "artifacts": files(out / "run_artifacts") if (out / "run_artifacts").is_dir() else []}


def _same_side_effects(loop: dict, other: dict, granularity: str) -> None:
    assert other["keys"].keys() == loop["keys"].keys(), granularity
    for step, keys in loop["keys"].items():
        assert other["keys"][step] == keys, (granularity, step, set(other["keys"][step]) ^ set(keys))
    assert list(other["rows"]) == list(loop["rows"]) == [f"round_{r:06d}.parquet" for r in range(1, 5)], granularity
    for name, table in loop["rows"].items():
        pd.testing.assert_frame_equal(other["rows"][name], table, check_like=True, obj=f"{granularity}: {name}")
    assert other["checkpoints"] == loop["checkpoints"] and len(loop["checkpoints"]) == 1, granularity
    assert other["artifacts"] == loop["artifacts"] and loop["artifacts"], granularity
