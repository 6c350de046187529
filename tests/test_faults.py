"""Faults injected into a real run (tiny model, DeepSpeed on gloo): half-written checkpoints,
NaN/inf in logits, rewards, advantages, gradients and weights, and out-of-memory errors.
Each test injects the fault through the product's own path and asserts what the run does."""

from __future__ import annotations

import logging
import math
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from rlhf.checkpoint import rounds as ckpt
from rlhf.round import stages
from rlhf.trainer.faults import NonFiniteStateError, RecoverableOOMError
from tests.test_trainer import tiny_cfg

FAULT_CFG = ("algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.001", "early_stop.enable=true",
             "early_stop.kl_ceiling=1e9", "early_stop.kl_patience=1000", "trainer.val_before_train=false",
             "trainer.test_freq=1000", "trainer.total_rounds=1000", "actor.entropy_coeff=0.01")


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from rlhf.train import Run

    r = Run(tiny_cfg(tmp_path_factory.mktemp("faults"), *FAULT_CFG))
    r.round()  # two clean rounds: two checkpoints, and the policy has moved off the reference
    r.round()
    yield r
    r.close()


def _scored(run, seed: int = 1):
    prompts, _ = stages.sample_prompts(run.data.train, run.state, run.cfg)
    return stages.score(stages.rollout(run.engine, run.tokenizer, prompts, run.cfg, seed=seed), run.cfg)


@contextmanager
def _hook(module: torch.nn.Module, fn, kind: str = "forward"):
    kw = {"with_kwargs": True} if kind == "forward_pre" else {}
    handle = getattr(module, f"register_{kind}_hook")(fn, **kw)
    try:
        yield
    finally:
        handle.remove()


def _nan_output(module, inputs, output):
    return output * float("nan")


def _update_with_fault(run, module: torch.nn.Module, fn, kind: str = "forward", kl_finite: bool = True,
                       critic_hit: bool = True) -> dict[str, float]:
    """One PPO step over a fresh scored batch with `fn` hooked into `module`; asserts the
    step was dropped: policy untouched (and the critic, when the fault reaches its loss),
    one step counted, and a KL coefficient that stays finite (unchanged when the fault made
    the KL itself non-finite)."""
    scored = _scored(run)
    actor, critic = _params(run.trainer.actor.module), _params(run.trainer.critic.module)
    kl_coef, skipped = run.trainer.kl_ctrl.value, run.trainer.skipped_steps
    with _hook(module, fn, kind):
        (m,) = stages.update(run.trainer, scored, run.tokenizer.pad_token_id, run.cfg)
    assert m["training/step_skipped"] == 1.0 and run.trainer.skipped_steps == skipped + 1
    assert _same(actor, _params(run.trainer.actor.module)), "a non-finite step changed the policy"
    assert _same(critic, _params(run.trainer.critic.module)) == critic_hit, "critic update wrongly applied/dropped"
    assert math.isfinite(run.trainer.kl_ctrl.value)
    assert math.isfinite(m["actor/current_kl"]) == kl_finite
    if not kl_finite:
        assert run.trainer.kl_ctrl.value == kl_coef
    return m


# -- divergence -------------------------------------------------------------------------------------


def test_nan_logits_skip_the_step_and_leave_the_kl_controller(run):
    """NaN logits (final hidden state of the policy) in every forward of the update: the
    behaviour log-probs, the KL and the loss are NaN; nothing is applied, kl_coef keeps its value."""
    _update_with_fault(run, run.trainer.actor.module.model.norm, _nan_output, kl_finite=False)


def test_nan_values_make_nan_advantages_and_skip_the_step(run):
    """NaN values from the critic poison GAE's advantages for the whole (whitened) batch."""
    m = _update_with_fault(run, run.trainer.critic.module.backbone.norm, _nan_output)
    assert math.isnan(m["critic/advantages/mean"])


def test_inf_gradients_skip_the_step(run):
    """Finite loss, infinite gradients (a backward hook inside the policy): the guard drops the
    policy's update; the critic's own (finite) update is applied."""
    layer = run.trainer.actor.module.model.layers[0].mlp

    def inf_grad(module, grad_input, grad_output):
        return tuple(g * float("inf") if g is not None else None for g in grad_input)

    m = _update_with_fault(run, layer, inf_grad, kind="full_backward", critic_hit=False)
    assert m["training/skipped_updates"] >= 1.0  # every actor mini-batch of the step (per PPO epoch)
    assert math.isfinite(m["actor/pg_loss"])


def test_checkpoint_of_non_finite_weights_is_refused(run, caplog):
    """A NaN weight (a state the update guards should never let through): the save raises,
    logs the tensor's name, and leaves neither a new checkpoint nor a temporary directory."""
    run.flush()  # the fixture's last checkpoint is written in the background; list it once sealed
    before = sorted(p.name for p in ckpt.checkpoint_root(run.out).iterdir())
    p = run.trainer.actor.module.model.layers[1].mlp.up_proj.weight
    old = p.detach().clone()
    with torch.no_grad():
        p[0, 0] = float("inf")
    try:
        with caplog.at_level(logging.ERROR, logger="rlhf.checkpoint"), pytest.raises(NonFiniteStateError) as e:
            run.save()
    finally:
        with torch.no_grad():
            p.copy_(old)
    assert "actor/model.layers.1.mlp.up_proj.weight" in str(e.value)
    assert "refusing to write checkpoint" in caplog.text
    assert sorted(p.name for p in ckpt.checkpoint_root(run.out).iterdir()) == before


# -- out of memory ----------------------------------------------------------------------------------


def _oom_above(rows: int):
    """A forward pre-hook that raises the CUDA allocator's error for batches of more than `rows` rows."""

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[0] > rows:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({ids.shape[0]} rows)")

    return hook


def test_oom_in_update_names_the_settings_and_a_retry_with_lower_settings_works(run, tmp_path):
    """The update's micro-batch of 8 rows runs out of memory: a RecoverableOOMError names
    actor.ppo_micro_batch_size_per_gpu=8 (and the token budget); the same round, resumed
    from the checkpoint with micro-batches of 4, completes."""
    from rlhf.train import Run

    shutil.copytree(run.out, tmp_path / "out", ignore=shutil.ignore_patterns("mlflow*"))
    scored = _scored(run)
    actor = _params(run.trainer.actor.module)
    backbone = run.trainer.actor.module.model
    with _hook(backbone, _oom_above(4), "forward_pre"):
        with pytest.raises(RecoverableOOMError) as e:
            stages.update(run.trainer, scored, run.tokenizer.pad_token_id, run.cfg)
    msg = str(e.value)
    assert "PPO update" in msg and "actor.ppo_micro_batch_size_per_gpu=8" in msg
    assert "actor.ppo_max_token_len_per_gpu" in msg and "Tried to allocate 2.00 GiB" in msg
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
    assert _same(actor, _params(run.trainer.actor.module))

    retry = Run(tiny_cfg(tmp_path / "out", *FAULT_CFG, "actor.ppo_micro_batch_size_per_gpu=4",
                         "critic.ppo_micro_batch_size_per_gpu=4", "rollout.generate_batch_size=4"))
    try:
        with _hook(retry.trainer.actor.module.model, _oom_above(4), "forward_pre"), \
                _hook(retry.trainer.critic.module.backbone, _oom_above(4), "forward_pre"):
            retry.round()
    finally:
        retry.close()
    assert retry.resumed_from.endswith(ckpt.round_dir_name(run.state.round))
    assert retry.state.round == run.state.round + 1 and retry.state.skipped_steps == run.state.skipped_steps


def test_oom_in_rollout_names_the_rollout_settings(run):
    prompts, _ = stages.sample_prompts(run.data.train, run.state, run.cfg)
    with _hook(run.engine.model.model, _oom_above(0), "forward_pre"):
        with pytest.raises(RecoverableOOMError) as e:
            stages.rollout(run.engine, run.tokenizer, prompts, run.cfg, seed=1)
    assert "rollout" in str(e.value) and "rollout.generate_batch_size=" in str(e.value)
    assert "rollout.gpu_memory_utilization=0.5" in str(e.value)


# -- half-written checkpoints ---------------------------------------------------------------------


def _two_checkpoints(run, dest: Path) -> tuple[Path, Path]:
    """A copy of the run's output with two complete round checkpoints."""
    shutil.copytree(run.out, dest, ignore=shutil.ignore_patterns("mlflow*"))
    found = sorted(ckpt.checkpoint_root(dest).glob("round_*"))
    assert len(found) >= 2 and all(ckpt.is_complete(p) for p in found)
    return found[-2], found[-1]


@pytest.mark.parametrize("damage", ["truncated_weights", "no_manifest", "missing_engine_file", "tmp_not_renamed"])
def test_half_written_checkpoint_is_never_read(run, tmp_path, caplog, damage):
    """The newest checkpoint left as a crash during save leaves it: resume takes the previous
    one and the warning names the bad directory."""
    prev, last = _two_checkpoints(run, tmp_path / "out")
    bad = last
    if damage == "truncated_weights":
        f = last / "actor" / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "no_manifest":
        (last / ckpt.MANIFEST_FILE).unlink()
    elif damage == "missing_engine_file":
        next(p for p in (last / ckpt.ENGINE_DIR).rglob("*") if p.is_file()).unlink()
    else:  # the crash came before the rename: the newest name exists only as a temporary directory
        bad = last.parent / f".tmp_{last.name}"
        last.rename(bad)
        (bad / ckpt.MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="rlhf.checkpoint"):
        assert ckpt.latest_checkpoint(tmp_path / "out") == prev
    assert str(bad) in caplog.text


def test_resume_skips_a_truncated_checkpoint_and_rewrites_it(run, tmp_path):
    from rlhf.train import Run

    prev, last = _two_checkpoints(run, tmp_path / "out")
    f = last / "critic" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    r = Run(tiny_cfg(tmp_path / "out", *FAULT_CFG))
    try:
        assert r.resumed_from == str(prev) and r.state.round == ckpt.read_state(prev).round
        r.round()
    finally:
        r.close()
    assert ckpt.latest_checkpoint(tmp_path / "out") == last and ckpt.is_complete(last)


# -- repeated divergence ----------------------------------------------------------------------------


def _nan_reward_model(path: Path, tok) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))  # a diverged reward model
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_repeated_nan_rewards_from_a_reward_model_stop_the_run(run, tmp_path, caplog):
    """Rows scored by a reward model that returns NaN: every round's step is skipped and
    counted, the run stops after early_stop.max_nonfinite_steps with the reason, and every
    checkpoint written meanwhile holds the last finite weights."""
    from rlhf.rewards.model import RewardModel
    from rlhf.round.state import RoundState

    saved = run.reward_model, run.data
    run.reward_model = RewardModel(_nan_reward_model(tmp_path / "rm", run.tokenizer))
    run.data = stages.DataBundle(train=run.data.train.assign(reward_style="model"), val=run.data.val, sft=None)
    start = _params(run.trainer.actor.module)
    run.state = RoundState(**{**run.state.__dict__, "skipped_steps": 0})
    run.trainer.skipped_steps = 0
    limit = run.cfg.early_stop.max_nonfinite_steps
    try:
        with caplog.at_level(logging.WARNING, logger="rlhf.rewards.model"):
            verdicts = [run.round()[1] for _ in range(limit)]
    finally:
        run.reward_model, run.data = saved
    assert [v.stop for v in verdicts] == [False] * (limit - 1) + [True]
    assert verdicts[-1].reason == f"{limit} steps skipped for non-finite loss or gradients"
    assert run.state.stop_reason == verdicts[-1].reason and run.state.skipped_steps == limit
    assert "reward model at" in caplog.text and "returned nan" in caplog.text
    from safetensors.torch import load_file

    run.flush()  # the stop's checkpoint is written in the background
    saved_actor = load_file(str(ckpt.latest_checkpoint(run.out) / "actor" / "model.safetensors"))
    for k, v in saved_actor.items():
        assert torch.isfinite(v).all() and torch.equal(v, start[k]), k
