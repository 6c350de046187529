"""The PPO update and the in-process round loop on a tiny model (real DeepSpeed, gloo on CPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf.config import load_config

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=64",
    "model.sft.max_steps=20", "model.sft.batch_size=32", "model.sft.log_every=100",
    "data.synthetic.n_sft=200", "data.synthetic.n_train=400", "data.synthetic.n_val=32",
    "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=8", "rollout.n=2", "data.max_response_length=8",
    "actor.lr=1e-3", "critic.lr=1e-3", "trainer.logger=[none]", "trainer.device=cpu",
    "trainer.save_freq=1",  # a checkpoint every round: what the resume and fault tests interrupt
]


def _clean_env() -> dict[str, str]:
    """The environment for a child process, without the rendezvous variables this process set."""
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_cfg(tmp_path: Path, *extra: str):
    return load_config(None, TINY + [f"trainer.output_dir={tmp_path}"] + list(extra))


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from rlhf.train import Run

    # entropy_coeff > 0: the barely-trained tiny policy scores 0 everywhere, so the entropy
    # bonus is what moves it in the first round; the KL it opens then moves the critic.
    cfg = tiny_cfg(tmp_path_factory.mktemp("run"), "trainer.total_rounds=2", "actor.entropy_coeff=0.01")
    r = Run(cfg)
    yield r
    r.close()


def test_two_ppo_steps_change_parameters_and_stay_finite(run):
    before = _params(run.trainer.actor.module)
    critic_before = _params(run.trainer.critic.module)
    for _ in range(2):
        run.round()
    after = _params(run.trainer.actor.module)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert any(not torch.equal(critic_before[k], v) for k, v in _params(run.trainer.critic.module).items())
    hist = run.state.step_history
    assert len(hist) == 2 and run.state.global_step == 2
    for row in hist:
        for key in ("actor/pg_loss", "critic/vf_loss", "actor/entropy", "actor/grad_norm"):
            assert math.isfinite(row[key]), (key, row)
    assert run.state.skipped_steps == 0


def test_nonfinite_loss_is_skipped_and_counted(run):
    """A NaN score poisons the advantages: the step must be dropped, the weights untouched."""
    from rlhf.round import stages

    cfg = run.cfg
    prompts, _ = stages.sample_prompts(run.data.train, run.state, cfg)
    scored = stages.score(stages.rollout(run.engine, run.tokenizer, prompts, cfg, seed=1), cfg)
    scored.loc[0, "score"] = float("nan")
    before = _params(run.trainer.actor.module)
    skipped = run.trainer.skipped_steps
    metrics = stages.update(run.trainer, scored, run.tokenizer.pad_token_id, cfg)
    assert run.trainer.skipped_steps > skipped
    assert metrics[0]["training/step_skipped"] == 1.0
    after = _params(run.trainer.actor.module)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_adaptive_kl_controller_follows_kl(tmp_path):
    """Adaptive control in a real run: the coefficient rises after every step whose KL is
    above target and falls after every step whose KL is below it."""
    from rlhf.train import Run

    for name, target in (("low", 1e-8), ("high", 10.0)):
        cfg = tiny_cfg(tmp_path / name, "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.1",
                       f"algorithm.kl_ctrl.target_kl={target}", "algorithm.kl_ctrl.horizon=100",
                       "early_stop.enable=false", "actor.lr=5e-3", "actor.entropy_coeff=0.05",
                       "trainer.steps_per_round=2")
        r = Run(cfg)
        try:
            r.round()
            r.round()
            hist = r.state.step_history
            coefs = [h["actor/reward_kl_penalty_coeff"] for h in hist] + [r.state.kl_coef]
        finally:
            r.close()
        kls = [h["actor/current_kl"] for h in hist]
        moves = [(kl > target, after > before) for kl, before, after in zip(kls, coefs, coefs[1:])]
        assert all(above == rose for above, rose in moves), (name, kls, coefs)
        if name == "low":
            assert any(above for above, _ in moves), "the policy never moved away from the reference"


def _final_actor(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from rlhf.checkpoint.rounds import latest_checkpoint

    last = latest_checkpoint(out)
    return load_file(str(last / "actor" / "model.safetensors"))


def test_resume_matches_uninterrupted_run(tmp_path):
    from rlhf.train import train

    extra = ["trainer.total_rounds=3", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.001",
             "algorithm.kl_ctrl.horizon=50", "early_stop.enable=false", "trainer.val_before_train=false",
             "trainer.test_freq=10"]
    full = train(tiny_cfg(tmp_path / "full", *extra))
    # Interrupted after round 1: a first run stops there, a second resumes from its checkpoint.
    part = tmp_path / "part"
    train(tiny_cfg(part, *[e for e in extra if not e.startswith("trainer.total_rounds")], "trainer.total_rounds=1"))
    resumed = train(tiny_cfg(part, *extra))
    assert resumed["resumed_from"].endswith("round_000001")
    assert resumed["global_steps"] == full["global_steps"] == 3
    assert resumed["kl_coef"] == pytest.approx(full["kl_coef"], rel=1e-9)
    a, b = _final_actor(tmp_path / "full"), _final_actor(part)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_half_written_checkpoint_is_ignored(tmp_path):
    from rlhf.checkpoint.rounds import latest_checkpoint, write_manifest

    root = tmp_path / "checkpoints"
    good = root / "round_000001"
    (good / "actor").mkdir(parents=True)
    (good / "actor" / "config.json").write_text("{}")
    (good / "state.json").write_text("{}")
    write_manifest(good)
    (root / "round_000002" / "actor").mkdir(parents=True)  # crashed before state.json
    (root / ".tmp_round_000003").mkdir()
    assert latest_checkpoint(tmp_path) == good


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path):
    """torchrun with 2 gloo ranks: identical weights on both ranks, and the same update
    (loss, weights) as one process on the same global batch."""
    script = ROOT / "tests" / "dp_update.py"
    env = _clean_env()
    single = subprocess.run([sys.executable, str(script), str(tmp_path / "one")], env=env, capture_output=True,
                            text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    double = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             f"--rdzv-endpoint=127.0.0.1:{_free_port()}", str(script),
                             str(tmp_path / "two")], env=env, capture_output=True, text=True, timeout=600)
    assert double.returncode == 0, double.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "rank0.json").read_text())
    r0 = json.loads((tmp_path / "two" / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "two" / "rank1.json").read_text())
    assert r0["checksum"] == r1["checksum"], "ranks diverged"
    assert r0["pg_loss"] == pytest.approx(one["pg_loss"], abs=1e-4)
    assert r0["vf_loss"] == pytest.approx(one["vf_loss"], rel=1e-3, abs=1e-4)
    assert r0["checksum"] == pytest.approx(one["checksum"], rel=1e-5)
    assert r0["max_param_diff_vs_start"] > 0


@pytest.mark.slow
def test_training_logs_to_mlflow_server_over_http(tmp_path, mlflow_server):
    """Two rounds logged to a real `mlflow server`; read back with MlflowClient."""
    from mlflow.tracking import MlflowClient

    from rlhf.train import train

    cfg = tiny_cfg(tmp_path, "trainer.total_rounds=2", "trainer.logger=[console,mlflow]",
                   f"trainer.mlflow_tracking_uri={mlflow_server}", "trainer.project_name=ci-trainer",
                   f"trainer.experiment_name=run-{tmp_path.name}")
    summary = train(cfg)
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("ci-trainer")
    (run,) = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = 'run-{tmp_path.name}'")
    keys = set(run.data.metrics)
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
                 "critic/vf_loss", "critic/vf_explained_var", "critic/score/mean", "critic/advantages/mean",
                 "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "response_length/mean",
                 "response_length/clip_ratio", "timing_s/update_actor", "timing_s/gen", "perf/throughput",
                 "val/accuracy"):
        assert name in keys, name
    assert any(k.startswith("val-core/synthetic/arithmetic/reward/mean") for k in keys)
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")]
    assert sorted(steps) == [1, 2] and summary["global_steps"] == 2
    assert run.data.params["actor.clip_ratio"] == "0.2"
    assert len(client.get_metric_history(run.info.run_id, "val/accuracy")) == 3  # before training + 2 rounds
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "summary.json" in artifacts and "final_model" in artifacts


@pytest.mark.slow
@pytest.mark.vllm
def test_round_with_vllm_rollout_pushes_new_weights(tmp_path):
    """One round with the vLLM engine (CPU build): same result types; after the round the
    engine serves the updated policy (its greedy output equals the checkpoint's HF output)."""
    pytest.importorskip("vllm")
    from rlhf.round import stages
    from rlhf.models.load import load_causal_lm
    from rlhf.rollout.hf import HFRolloutEngine
    from rlhf.rollout.base import SamplingParams
    from rlhf.train import Run

    # vLLM's CPU attention needs a head size of at least 32.
    cfg = tiny_cfg(tmp_path, "rollout.name=vllm", "model.tiny.hidden_size=64", "actor.lr=2e-2",
                   "actor.entropy_coeff=0.05", "trainer.total_rounds=1")
    r = Run(cfg)
    try:
        r.round()
        ckpt_dir = r.save()
        r.flush()  # the checkpoint is written in the background
        prompts = stages.tokenize(r.data.val.head(16), r.tokenizer, cfg)
        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.data.max_response_length)
        served = r.engine.generate(prompts, greedy).response_ids
        hf = HFRolloutEngine(load_causal_lm(str(ckpt_dir / "actor")), r.tokenizer).generate(prompts, greedy)
        base = HFRolloutEngine(load_causal_lm(r.base_dir), r.tokenizer).generate(prompts, greedy)
    finally:
        r.close()
    assert served == hf.response_ids
    assert hf.response_ids != base.response_ids, "the update did not change the greedy policy; test is vacuous"
    assert not (tmp_path / "rollout_policy").exists(), "the weights go to vLLM in memory, not through files"
    assert r.timing["timing_s/update_weights"] > 0


def test_cli_writes_summary_json(tmp_path):
    env = _clean_env()
    summary_path = tmp_path / "s" / "summary.json"
    cmd = [sys.executable, "-m", "rlhf.train", *TINY, f"trainer.output_dir={tmp_path / 'out'}",
           "trainer.total_rounds=1", "--summary-json", str(summary_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    for key in ("val_score_start", "val_score_end", "val_score_best", "rounds", "global_steps", "stop_reason",
                "wall_s"):
        assert key in summary, key
    assert summary["rounds"] == 1 and summary["global_steps"] == 1
    assert "round 1/1" in proc.stdout


def test_cli_rejects_unknown_key_with_suggestion(tmp_path):
    env = _clean_env()
    proc = subprocess.run([sys.executable, "-m", "rlhf.train", "actor.clip_raito=0.3"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "did you mean 'actor.clip_ratio'" in proc.stderr
