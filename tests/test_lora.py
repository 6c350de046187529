"""LoRA on the actor and the critic (peft, verl's keys): only the adapters and the value head
train; the reference is the base model (the actor with its adapters off); merged weights give
the adapted model's logits; checkpoints hold the adapters and resume to the same weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlhf.config.load import load_config
from rlhf.config.schema import ConfigError
from rlhf.models import lora
from rlhf.checkpoint import rounds as ckpt
from test_trainer import tiny_cfg

pytest.importorskip("peft")

LORA = ["model.lora_rank=4", "model.lora_alpha=8", "critic.lora_rank=2", "critic.target_modules=[q_proj,v_proj]",
        "actor.entropy_coeff=0.05", "early_stop.enable=false",
        "trainer.val_before_train=false", "trainer.test_freq=10", "trainer.total_rounds=2",
        "critic.ppo_epochs=2"]  # the critic backbone's gradient needs a value head moved off its zero start


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A two-round LoRA run (a checkpoint after each round, the merged policy at the end),
    with the actor's and critic's weights before and after."""
    from rlhf.train import Run

    out = tmp_path_factory.mktemp("lora") / "full"
    r = Run(tiny_cfg(out, *LORA))
    try:
        actor, critic = r.trainer.actor, r.trainer.critic
        before = _snapshot(actor.module), _snapshot(critic.module)
        r.round()  # B starts at 0: the policy is the reference, the KL and so the returns 0 ...
        r.round()  # ... until the first update has moved the adapters
        after = _snapshot(actor.module), _snapshot(critic.module)
        trainable = [p for p in actor.module.parameters() if p.requires_grad]
        in_optimizer = [p for g in actor.optimizer.param_groups for p in g["params"]]
        assert {id(p) for p in in_optimizer} == {id(p) for p in trainable}
        assert sum(p.numel() for p in trainable) < sum(p.numel() for p in actor.module.parameters()) / 2
        r.flush()
        merged = ckpt.save_policy(out / "merged_policy", actor, r.tokenizer) / "actor"
    finally:
        r.close()
    return out, merged, before, after


# -- config ------------------------------------------------------------------------------------


def test_verl_keys_map_onto_the_lora_settings():
    cfg = load_config(None, ["actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=64",
                             "actor_rollout_ref.model.target_modules=all-linear", "critic.model.lora_rank=8",
                             "critic.model.target_modules=[q_proj,v_proj]",
                             r"critic.model.exclude_modules=.*layers\.0\..*"])
    assert lora.actor_spec(cfg) == lora.LoraSpec(32, 64, ("all-linear",), None, "model")
    assert lora.peft_targets(lora.actor_spec(cfg)) == "all-linear"
    assert lora.critic_spec(cfg).target_modules == ("q_proj", "v_proj")
    assert cfg.critic.exclude_modules == r".*layers\.0\..*"
    assert not lora.actor_spec(load_config(None, [])).enabled  # lora_rank 0 is off, as in verl
    with pytest.raises(ConfigError, match="lora_adapter_path"):
        load_config(None, ["actor_rollout_ref.model.lora_adapter_path=/x"])
    with pytest.raises(ConfigError, match="layered_summon"):
        load_config(None, ["actor_rollout_ref.rollout.layered_summon=true"])
    with pytest.raises(ConfigError, match="model.lora_rank"):
        load_config(None, ["model.lora_rank=-1"])
    with pytest.raises(lora.LoraSetupError, match="regular expressions"):
        lora.peft_targets(lora.LoraSpec(4, target_modules=(".*q_proj",)))


def test_targets_that_match_nothing_are_refused(tok):
    from tiny import small_model

    with pytest.raises(lora.LoraSetupError, match="model.target_modules=\\['no_such_layer'\\]"):
        lora.add_adapters(small_model(tok), lora.LoraSpec(4, target_modules=("no_such_layer",)))


# -- the model: adapters, reference, merge ------------------------------------------------------


def test_all_linear_adapts_every_linear_layer_but_the_lm_head_and_freezes_the_rest(tok):
    from tiny import small_model

    model = lora.add_adapters(small_model(tok), lora.LoraSpec(4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_lora_key(n) for n in trainable)
    adapted = {n.split(".lora_A.")[0] for n in trainable if ".lora_A." in n}
    linear = {n for n, m in small_model(tok).named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert adapted == linear
    # exclude_modules is a regular expression matched against the whole module path (peft's, verl's)
    model = lora.add_adapters(small_model(tok), lora.LoraSpec(4, exclude_modules=r".*layers\.0\..*"))
    adapted = {n.split(".lora_A.")[0] for n, p in model.named_parameters() if ".lora_A." in n}
    assert adapted == {n for n in linear if ".layers.0." not in n} and adapted


def test_reference_with_adapters_off_is_the_base_model_and_merge_matches(tok):
    """After an update, the base view gives the base model's logits exactly, and the merged
    state dict gives the adapted model's."""
    from tiny import small_model

    base = small_model(tok, seed=3).eval()
    model = lora.add_adapters(small_model(tok, seed=3), lora.LoraSpec(4, 8))
    with torch.no_grad():  # an update has moved B away from its zero start
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)
    ids = torch.randint(3, len(tok), (2, 12))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        ref = lora.BaseView(model)(input_ids=ids).logits
        hidden = lora.BaseView(model).base_model(input_ids=ids).last_hidden_state
        merged = small_model(tok, seed=3)
        merged.load_state_dict(lora.merged_state_dict(model.state_dict(), lora.lora_scaling(model)))
        merged_logits = merged.eval()(input_ids=ids).logits
    assert torch.equal(ref, base(input_ids=ids).logits)
    assert torch.equal(hidden, base.model(input_ids=ids).last_hidden_state)
    assert not torch.allclose(adapted, ref, atol=1e-3)
    torch.testing.assert_close(merged_logits, adapted, rtol=1e-4, atol=1e-4)
    assert all(p.requires_grad for n, p in model.named_parameters() if lora.is_lora_key(n))  # switched back on


# -- training, checkpoints, resume ---------------------------------------------------------------


def test_only_adapters_and_the_value_head_train(lora_run):
    _, _, (a0, c0), (a1, c1) = lora_run
    changed = {k for k in a0 if not torch.equal(a0[k], a1[k])}
    assert changed and all(lora.is_lora_key(k) for k in changed)
    changed = {k for k in c0 if not torch.equal(c0[k], c1[k])}
    assert "value_head.weight" in changed and all(lora.is_lora_key(k) or k.startswith("value_head.") for k in changed)
    assert any(lora.is_lora_key(k) for k in changed)


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_checkpoint_holds_adapters_and_is_a_small_fraction_of_a_full_one(lora_run, tmp_path):
    from rlhf.train import train

    out = lora_run[0]
    last = ckpt.latest_checkpoint(out)
    names = {p.name for p in (last / "actor").iterdir()}
    assert {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, "base_model.json", "config.json"} <= names
    assert ckpt.WEIGHTS_FILE not in names and ckpt.WEIGHTS_FILE not in {p.name for p in (last / "critic").iterdir()}
    full = train(tiny_cfg(tmp_path, *[k for k in LORA if k.split(".")[1].split("=")[0] not in (
        "lora_rank", "lora_alpha", "target_modules", "total_rounds")], "trainer.total_rounds=1"))
    ratio = _bytes(last) / _bytes(ckpt.latest_checkpoint(full["output_dir"]))
    assert ratio < 0.25, ratio  # 0.16 here: hidden size 32 makes rank-4 adapters relatively large


def test_saved_adapters_load_in_peft_and_merged_policy_matches(lora_run, tok):
    from peft import PeftModel

    from rlhf.models.load import load_causal_lm

    out, merged_dir = lora_run[:2]
    last = ckpt.latest_checkpoint(out)
    merged = load_causal_lm(str(merged_dir)).eval()
    from_ckpt = load_causal_lm(str(last / "actor")).eval()  # an adapter directory: the base, merged
    base_dir = lora.read_adapter_config(last / "actor")["base_model_name_or_path"]
    with_peft = PeftModel.from_pretrained(load_causal_lm(base_dir), str(last / "actor")).eval()
    ids = torch.randint(3, len(tok), (2, 10))
    with torch.no_grad():
        want = with_peft(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(from_ckpt(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(load_causal_lm(base_dir)(input_ids=ids).logits, want, atol=1e-4)


def test_resume_from_the_first_round_ends_with_the_same_adapters(lora_run, tmp_path):
    from safetensors.torch import load_file

    from rlhf.train import train

    full = lora_run[0]
    part = tmp_path / "part"
    shutil.copytree(full, part)
    first, second = sorted(ckpt.checkpoint_root(part).glob("round_*"))
    shutil.rmtree(second)
    resumed = train(tiny_cfg(part, *LORA, "trainer.save_merged=true"))
    assert resumed["resumed_from"] == str(first)
    want = load_file(str(lora_run[1] / ckpt.WEIGHTS_FILE))  # the uninterrupted run's merged actor
    got = load_file(str(Path(resumed["merged_policy"]) / ckpt.WEIGHTS_FILE))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    for model in ("actor", "critic"):
        for name in (lora.ADAPTER_WEIGHTS, "value_head.safetensors") if model == "critic" else (lora.ADAPTER_WEIGHTS,):
            a = load_file(str(ckpt.latest_checkpoint(full) / model / name))
            b = load_file(str(ckpt.latest_checkpoint(part) / model / name))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (model, name)


def _changed_copy(base: Path, dest: Path) -> Path:
    """A copy of the model directory `base` with one byte of its weights changed."""
    shutil.copytree(base, dest)
    f = next(dest.glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    return dest


def test_resume_refuses_adapters_of_another_base(lora_run, tmp_path):
    import json

    from rlhf.checkpoint.adapters import check_base

    out = lora_run[0]
    actor = ckpt.latest_checkpoint(out) / "actor"
    base = Path(json.loads((actor / "base_model.json").read_text())["path"])
    other = _changed_copy(base, tmp_path / "other")
    check_base(actor, str(base))
    with pytest.raises(lora.LoraSetupError, match="trained on other base weights"):
        check_base(actor, str(other))


@pytest.mark.parametrize("engine", [pytest.param(["deepspeed.zero_stage=3"], marks=pytest.mark.slow),
                                    ["deepspeed.bf16=true", "model.dtype=bfloat16"]], ids=["zero3", "bf16-master-adam"])
def test_engines_train_the_adapters_and_hand_merged_weights_to_a_rollout(tmp_path, engine):
    """ZeRO-3 (adapters partitioned, gathered for the merge) and bf16 at stage 0 (MasterAdamW's
    float32 masters of the adapters only): one round moves the adapters, and the merged policy a
    vLLM engine would load gives the adapted actor's logits."""
    from rlhf.models.load import load_causal_lm
    from rlhf.train import Run

    r = Run(tiny_cfg(tmp_path / "out", *LORA, *engine))
    try:
        module = r.trainer.actor.module
        r.round()
        policy = ckpt.save_policy(tmp_path / "policy", r.trainer.actor, r.tokenizer)
        ids = torch.randint(3, len(r.tokenizer), (2, 10))
        with torch.no_grad():
            want = module.eval()(input_ids=ids).logits.float()
        opt = r.trainer.actor.optimizer
        masters = getattr(opt, "masters", None)
        if masters is not None:  # MasterAdamW: float32 copies of the adapters, nothing else
            assert len(masters) == len([p for p in module.parameters() if p.requires_grad])
            assert all(m.dtype == torch.float32 for m in masters)
    finally:
        r.close()
    merged = load_causal_lm(str(policy / "actor"), dtype=r.cfg.model.dtype).eval()
    assert not lora.is_adapter_dir(policy / "actor")
    with torch.no_grad():
        got = merged(input_ids=ids).logits.float()
        base = load_causal_lm(r.base_dir, dtype=r.cfg.model.dtype).eval()(input_ids=ids).logits.float()
    assert not torch.allclose(got, base, atol=1e-3), "the update moved no adapter"
    tol = 1e-4 if r.cfg.model.dtype == "float32" else 5e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)



@pytest.mark.slow
def test_smollm2_reference_merge_and_adapter_share(smollm2_dir, one_thread):
    """On a real pretrained model (SmolLM2-135M, Llama, tied embeddings): rank-8 adapters on all
    linear layers are under 2% of its parameters; with them off it is the base model exactly,
    and merged into the weights it gives the adapted logits."""
    from rlhf.models.load import load_causal_lm

    base = load_causal_lm(smollm2_dir).eval()
    model = lora.add_adapters(load_causal_lm(smollm2_dir), lora.LoraSpec(8, 16)).eval()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < 0.02 * sum(p.numel() for p in base.parameters())
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.02)
        ids = torch.randint(100, 40000, (1, 16))
        want = base(input_ids=ids).logits
        assert torch.equal(lora.BaseView(model)(input_ids=ids).logits, want)
        adapted = model(input_ids=ids).logits
        assert not torch.allclose(adapted, want, atol=1e-2)
        base.load_state_dict(lora.merged_state_dict(model.state_dict(), lora.lora_scaling(model)), strict=False)
        torch.testing.assert_close(base(input_ids=ids).logits, adapted, rtol=1e-3, atol=1e-3)


# -- the Flyte pipeline: trainer.save_merged gives the merged policy as its model output ----------


def test_flyte_pipeline_outputs_the_merged_policy(tmp_path, monkeypatch):
    """With `trainer.save_merged`, the Flyte pipeline's model output (what the report names) is a
    plain model directory: the final checkpoint's adapters merged into the base, the logits peft
    gives with them merged, which are not the base model's."""
    from peft import PeftModel

    from rlhf.models.load import load_causal_lm
    from workflows.ppo import ppo_pipeline

    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")
    keys = [k for k in LORA if not k.startswith(("critic.", "trainer.total_rounds"))]
    out = ppo_pipeline(cfg=tiny_cfg(tmp_path, *keys, "trainer.total_rounds=1", "trainer.save_merged=true"))
    merged_dir = Path(out.model.download())
    adapters = Path(out.state.checkpoints[-1]) / "actor"
    assert lora.is_adapter_dir(adapters), "the checkpoint should hold the adapters"
    assert not (merged_dir / lora.ADAPTER_CONFIG).exists() and not lora.is_adapter_dir(merged_dir)
    assert (merged_dir / "config.json").is_file()
    base_dir = lora.read_adapter_config(adapters)["base_model_name_or_path"]
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = load_causal_lm(str(merged_dir)).eval()(input_ids=ids).logits
        want = PeftModel.from_pretrained(load_causal_lm(base_dir), str(adapters)).merge_and_unload().eval()(
            input_ids=ids).logits
        base = load_causal_lm(base_dir).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, base, atol=1e-4), "the round moved no adapter"


def test_merge_task_refuses_adapters_of_another_base_and_passes_plain_policies_on(lora_run, tmp_path):
    import dataclasses

    from flytekit.types.directory import FlyteDirectory

    from tasks.run import merge_policy

    out = lora_run[0]
    actor = ckpt.latest_checkpoint(out) / "actor"
    base = Path(lora.read_adapter_config(actor)["base_model_name_or_path"])
    other = _changed_copy(base, tmp_path / "other")
    cfg = tiny_cfg(out, *LORA, "trainer.save_merged=true")
    with pytest.raises(Exception, match="trained on other base weights") as err:
        merge_policy(cfg=cfg, base_model=FlyteDirectory(path=str(other)), policy=FlyteDirectory(path=str(actor)))
    message = str(err.value)
    assert str(actor) in message and "trainer.save_merged=false" in message and "model.path" in message, message
    # without save_merged, the policy is passed on as it is
    plain = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, save_merged=False))
    kept = merge_policy(cfg=plain, base_model=FlyteDirectory(path=str(other)), policy=FlyteDirectory(path=str(actor)))
    assert Path(kept.path) == actor
