"""verl's keys mean verl's run: gradient checkpointing for the actor and the critic, lists of
dataset files, epochs that drop the last partial batch, `save_freq=-1`, validation before
training, and the quickstart's dry run printing verl 0.9.1's defaults."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from rlhf.config import load_config
from rlhf.data.arithmetic import make_arithmetic
from rlhf.data.io import write_table_atomic
from rlhf.data.sampling import PromptSampler
from rlhf.checkpoint import rounds as ckpt
from rlhf.round import rules, stages
from rlhf.round.state import RoundState

from test_trainer_estimators import hand_batch, make_trainer
from test_verl_keys import QUICKSTART

AR = "actor_rollout_ref"


# -- gradient checkpointing ---------------------------------------------------------------------


def _calls_of_first_layer(module) -> list[int]:
    """A counter of the first decoder layer's MLP forward calls (a recomputation in backward
    calls it again; torch's checkpoint reruns `forward` without the module's hooks)."""
    hf = getattr(module, "backbone", None) or module.model
    mlp, calls = hf.layers[0].mlp, [0]
    forward = mlp.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    mlp.forward = counted
    return calls


def test_gradient_checkpointing_reaches_both_models_and_keeps_the_update():
    """verl's keys switch recomputation on in the engines' models: each layer runs again in
    backward, and the step's losses, gradient norms and new weights are those without it."""
    def keys(flag: str) -> list[str]:
        return [f"{AR}.model.enable_gradient_checkpointing={flag}", f"critic.model.enable_gradient_checkpointing={flag}",
                "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true"]

    on, _ = make_trainer(*keys("true"), critic=True)
    off, _ = make_trainer(*keys("false"), critic=True)
    assert on.actor.module.is_gradient_checkpointing and on.critic.module.backbone.is_gradient_checkpointing
    assert not off.actor.module.is_gradient_checkpointing and not off.critic.module.backbone.is_gradient_checkpointing
    calls = {name: (_calls_of_first_layer(t.actor.module), _calls_of_first_layer(t.critic.module))
             for name, t in (("on", on), ("off", off))}
    buf = hand_batch([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    (m_on,), (m_off,) = on.round(buf, 1), off.round(buf, 1)
    for k in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert m_on[k] == pytest.approx(m_off[k], rel=1e-5, abs=1e-7), k
    for a, b in ((on.actor.module, off.actor.module), (on.critic.module, off.critic.module)):
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)
    # the same forwards outside backward (log-probs, values, update passes); with it, one more per update pass
    assert calls["on"][0][0] > calls["off"][0][0] and calls["on"][1][0] > calls["off"][1][0]


def test_critic_checkpointing_follows_the_actors_unless_set():
    from rlhf.trainer.engines import gradient_checkpointing

    both = load_config(None, ["model.enable_gradient_checkpointing=true"])
    assert gradient_checkpointing(both, critic=False) and gradient_checkpointing(both, critic=True)
    actor_only = load_config(None, [f"{AR}.model.enable_gradient_checkpointing=true",
                                    "critic.model.enable_gradient_checkpointing=false"])
    assert gradient_checkpointing(actor_only, critic=False) and not gradient_checkpointing(actor_only, critic=True)


# -- dataset file lists -----------------------------------------------------------------------------


def test_lists_of_train_and_val_files_mix_sources_and_keep_each_rows_source(tmp_path, word_problem_files):
    """verl's examples give `data.train_files="['gsm8k/train.parquet', 'math/train.parquet']"`: each
    file is read (local paths and fsspec URIs alike) and the rows concatenated with their data_source."""
    from rlhf.train.check import preflight

    arithmetic = str(tmp_path / "arithmetic.parquet")
    make_arithmetic(12, seed=1).to_parquet(arithmetic)
    uri = "memory://verl-lists/arithmetic_val.parquet"
    import pyarrow as pa

    write_table_atomic(pa.Table.from_pandas(make_arithmetic(5, seed=2), preserve_index=False), uri)
    cfg = load_config(None, [f"data.train_files=['{word_problem_files['train']}', '{arithmetic}']",
                             f"data.val_files=[{word_problem_files['test']}, {uri}]"])
    assert cfg.data.train_files == [word_problem_files["train"], arithmetic]
    bundle = stages.prepare_data(cfg)
    sources = bundle.train["data_source"].tolist()
    assert sources == ["openai/gsm8k"] * 16 + ["synthetic/arithmetic"] * 12
    assert bundle.val["data_source"].value_counts().to_dict() == {"openai/gsm8k": 4, "synthetic/arithmetic": 5}
    one = load_config(None, [f"data.train_files={arithmetic}", f"data.val_files={uri}"])
    assert (one.data.train_files, one.data.val_files) == ([arithmetic], [uri])  # one path: a list of one
    from rlhf.config import PPOConfig

    flyte = PPOConfig.from_json(json.dumps({"data": {"train_files": arithmetic, "val_files": [uri]}}))  # pyflyte --cfg
    assert (flyte.data.train_files, flyte.data.val_files) == ([arithmetic], [uri])
    local = load_config(None, [f"data.train_files=[{word_problem_files['train']}, {arithmetic}]",
                               f"data.val_files=[{word_problem_files['test']}, {arithmetic}]"])
    assert "28 train rows" in preflight(local).text()


# -- epochs, save_freq, validation ------------------------------------------------------------------


def test_an_epochs_last_partial_batch_is_dropped_as_verls_loader_drops_it():
    sampler = PromptSampler(n_rows=10, batch_size=4, seed=0, drop_last=True)
    epochs = [sampler.next_indices() for _ in range(6)]  # 2 full batches an epoch; rows 8-9 of each order unused
    for e in range(3):
        first, second = epochs[2 * e], epochs[2 * e + 1]
        assert np.array_equal(np.concatenate([first, second]), sampler.order(e)[:8])
    assert len({tuple(b) for b in epochs}) == 6
    small = PromptSampler(n_rows=3, batch_size=7, seed=0, drop_last=True)  # no full batch: wraps as before
    assert sorted(small.next_indices()[:3].tolist()) == [0, 1, 2]


def test_a_round_draws_its_steps_batches_as_verls_loader_would():
    train = pd.DataFrame({"prompt": [f"p{i}" for i in range(10)]})
    cfg = load_config(None, ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "trainer.steps_per_round=2"])
    state, seen = RoundState(), []
    for _ in range(3):
        rows, state = stages.sample_prompts(train, state, cfg)
        seen.append(rows["prompt"].tolist())
    reference = PromptSampler(10, 4, seed=cfg.trainer.seed, drop_last=True)
    expected = [reference.next_indices() for _ in range(6)]
    assert seen == [[f"p{i}" for i in np.concatenate(expected[2 * r:2 * r + 2])] for r in range(3)]
    assert (state.epoch, state.cursor) == (2, 8)


def test_save_freq_minus_one_saves_no_checkpoint():
    """verl's `save_freq=-1`: `save_freq > 0 and (is_last_step or step % save_freq == 0)` never holds."""
    never = load_config(None, ["trainer.save_freq=-1", "trainer.total_rounds=4"]).trainer
    assert not any(ckpt.is_save_point(never, r) or ckpt.should_save(never, r, stopping=True) for r in range(1, 6))
    every2 = load_config(None, ["trainer.save_freq=2", "trainer.total_rounds=5"]).trainer
    assert [r for r in range(1, 6) if ckpt.is_save_point(every2, r)] == [2, 4, 5]


def test_validation_before_training_runs_with_test_freq_minus_one():
    """verl validates before training when `val_before_train` whatever its test_freq."""
    verl = load_config(None, [f"{AR}.rollout.name=hf"])
    assert (verl.trainer.test_freq, verl.trainer.val_before_train) == (-1, True)
    assert rules.should_validate_first(verl, RoundState())
    assert not any(rules.should_evaluate(verl, r) for r in range(1, 10))
    off = load_config(None, ["trainer.test_freq=-1", "trainer.val_before_train=false"])
    assert not rules.should_validate_first(off, RoundState())


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory) -> str:
    """A small random Llama and the char tokenizer, saved as a model directory."""
    from rlhf.models.load import save_model_atomic
    from rlhf.models.tokenizer import build_char_tokenizer
    from tiny import small_model

    tok = build_char_tokenizer()
    path = str(tmp_path_factory.mktemp("policy") / "m")
    save_model_atomic(small_model(tok), tok, path)
    return path


@pytest.mark.slow
def test_in_process_run_with_save_freq_minus_one_writes_the_final_policy_only(tmp_path, small_policy):
    import rlhf.train
    from safetensors.torch import load_file

    from test_trainer import TINY

    cfg = load_config(None, [*(k for k in TINY if not k.startswith("trainer.save_freq")), f"model.path={small_policy}",
                             f"trainer.output_dir={tmp_path}", "trainer.total_rounds=2", "trainer.save_freq=-1",
                             "trainer.test_freq=-1", "trainer.val_before_train=false",
                             "actor.entropy_coeff=0.05"])  # a gradient whatever the random policy writes
    summary = rlhf.train.train(cfg)
    assert summary["rounds"] == 2
    root = ckpt.checkpoint_root(tmp_path)
    assert not root.exists() or not any(p.name.startswith("round_") for p in root.iterdir())
    final = tmp_path / "final_policy" / "actor"
    assert summary["final_policy"] == str(final.resolve())
    before, after = load_file(f"{small_policy}/model.safetensors"), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before), "the final policy is the trained one"


# -- the quickstart's dry run -------------------------------------------------------------------------


def _as_printed(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@pytest.fixture(scope="module")
def quickstart_files(tmp_path_factory):
    """GSM8K-layout train and test files (enough rows for one batch of 256) and a small model
    whose position limit holds the quickstart's 512 + 512 tokens."""
    from rlhf.config import TinyModelConfig
    from rlhf.data.word_problems import write_splits
    from rlhf.models.load import save_model_atomic
    from rlhf.models.tiny import build_tiny_model
    from rlhf.models.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("quickstart")
    files = write_splits(str(root), {"train": 300, "test": 8}, seed=5)
    tok = build_char_tokenizer()
    shape = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                            num_key_value_heads=1, max_position_embeddings=1024)
    model = build_tiny_model(shape, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=0)
    save_model_atomic(model, tok, str(root / "model"))
    return {**files, "model": str(root / "model")}


def test_quickstart_dry_run_prints_verl_0_9_1s_defaults(quickstart_files, capsys):
    """The GSM8K quickstart's command line, given to `python -m rlhf.train --dry-run`: the line it
    prints names verl's defaults, and every value on it is verl 0.9.1's (its generated config)."""
    omegaconf = pytest.importorskip("omegaconf")
    from rlhf.train.cli import main
    from test_verl_defaults import EQUAL, GENERATED, NULL_HERE

    paths = {"/data/gsm8k/train.parquet": quickstart_files["train"], "/data/gsm8k/test.parquet":
             quickstart_files["test"], "/models/Qwen2.5-0.5B-Instruct": quickstart_files["model"]}
    argv = [next((f"{t.split('=')[0]}={v}" for p, v in paths.items() if t.endswith(p)), t) for t in QUICKSTART]
    assert main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("defaults:"))
    assert line.startswith("defaults: verl 0.9.1's") and "launch checked" in out
    shown = dict(item.split("=", 1) for item in line.split(": ")[-1].split())
    generated = omegaconf.OmegaConf.load(GENERATED)
    verl_path = {ours: v for v, ours in EQUAL.items()} | {ours: v for v, (ours, _) in NULL_HERE.items()}
    assert {"algorithm.use_kl_in_reward", "rollout.n", "rollout.temperature", "algorithm.kl_ctrl.target_kl",
            "actor.weight_decay", "critic.weight_decay", "model.enable_gradient_checkpointing",
            "data.use_sequence_packing", "data.filter_overlong_prompts",
            "algorithm.rollout_correction.rollout_is"} <= set(shown)
    null_here = dict(NULL_HERE.values())  # this project's spelling of verl's null
    for key, text in shown.items():
        if key == "early_stop.enable":
            assert text == "false"  # verl has no early stopping
            continue
        value = omegaconf.OmegaConf.select(generated, verl_path[key])
        if value is None and key in null_here:
            value = null_here[key]
        assert text == _as_printed(value), (key, text, value)
    # the quickstart's own values stand: 256 prompts, a 512-token response, kl_coef 0.001, save_freq 10
    assert not {"data.train_batch_size", "trainer.save_freq", "trainer.test_freq"} & set(shown)


def test_the_flyte_launch_says_which_defaults_are_in_force(capsys):
    """`pyflyte run ... ppo_pipeline` prints the same defaults line as `python -m rlhf.train`,
    from its first task (check_config, run here as flytekit runs it locally)."""
    from tasks import run

    verl_launch = load_config(None, ["actor_rollout_ref.rollout.n=2", "data.train_batch_size=8",
                                     "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_prompt_length=32",
                                     "data.max_response_length=16", "trainer.total_epochs=1"])
    assert run.check_config(cfg=verl_launch).defaults == "verl"
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("defaults:")]
    assert len(line) == 1 and "verl 0.9.1's" in line[0] and "algorithm.use_kl_in_reward=false" in line[0], line
    run.check_config(cfg=load_config(None, []))
    assert "defaults: this project's" in capsys.readouterr().out
