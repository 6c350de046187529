"""Keys that used to be declared without effect now act: data.val_batch_size,
rollout.val_temperature, model.dtype / model.trust_remote_code for vLLM, model.allow_network."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from rlhf.train import setup as P
from rlhf.round.evaluate import evaluate
from rlhf.config import derive_sizes, load_config
from rlhf.rollout.base import RolloutBatch


class RecordingEngine:
    """Answers every prompt with '1' and records each generate call."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params))
        n = len(prompts)
        return RolloutBatch(prompt_ids=prompts, response_ids=[[5]] * n, response_text=["#### 1"] * n,
                            logprobs=[[0.0]] * n, finish_reason=["stop"] * n, group_ids=list(range(n)),
                            prompt_index=list(range(n)))


def _val(n: int) -> pd.DataFrame:
    return pd.DataFrame({"prompt": [f"{i}+0=" for i in range(n)], "data_source": "synthetic/arithmetic",
                         "ability": "math", "reward_style": "rule", "ground_truth": [str(i) for i in range(n)],
                         "extra_info": "{}"})


def test_val_batch_size_splits_the_validation_generate_calls():
    from rlhf.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    for size, expected in ((3, [3, 3, 1]), (0, [7])):
        engine = RecordingEngine()
        m = evaluate(engine, tok, _val(7), load_config(None, [f"data.val_batch_size={size}"]))
        assert [c[0] for c in engine.calls] == expected
        assert m["val/n"] == 7 and m["val/accuracy"] == pytest.approx(1 / 7)  # only "1+0=" is right


def test_val_temperature_reaches_the_validation_sampler():
    from rlhf.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    for temp in (0.0, 0.7):
        engine = RecordingEngine()
        evaluate(engine, tok, _val(2), load_config(None, [f"rollout.val_temperature={temp}", "trainer.seed=3"]))
        (_, params), = engine.calls
        assert params.temperature == temp and params.n == 1
        assert params.seed == (3 if temp > 0 else None)


def test_vllm_engine_gets_model_dtype_and_trust_remote_code(tmp_path, monkeypatch):
    import rlhf.rollout.vllm as V
    from rlhf.rollout import make_engine

    seen = {}
    monkeypatch.setattr(V, "VLLMRolloutEngine", lambda model_dir, cfg, seed, **kw: seen.update(kw) or "engine")
    monkeypatch.setattr(V, "_PARKED", [])  # no engine parked by another test is reused
    cfg = load_config(None, ["model.dtype=bfloat16", "model.trust_remote_code=true", "rollout.name=vllm"])
    with pytest.raises(FileNotFoundError, match="does not exist"):  # checked before any engine is built
        make_engine("vllm", str(tmp_path / "missing"), None, cfg.rollout)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert make_engine("vllm", str(tmp_path), None, cfg.rollout, dtype=cfg.model.dtype,
                       trust_remote_code=cfg.model.trust_remote_code) == "engine"
    assert seen == {"dtype": "bfloat16", "trust_remote_code": True, "max_model_len": None}
    kw = V.engine_kwargs("/m", cfg.rollout, 0, on_cpu=True, dtype="bfloat16", trust_remote_code=True)
    assert kw["dtype"] == "bfloat16" and kw["trust_remote_code"] is True
    assert V.engine_kwargs("/m", cfg.rollout, 0, on_cpu=True)["trust_remote_code"] is False


def test_allow_network_reaches_every_loader(tmp_path, monkeypatch):
    import rlhf.models.load as L
    from rlhf.trainer.default_policy import build_tiny_policy

    cfg = load_config(None, ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=1",
                             "model.tiny.num_attention_heads=1", "model.tiny.num_key_value_heads=1",
                             "model.tiny.intermediate_size=32", "model.allow_network=true", "trainer.device=cpu",
                             "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2"])
    model, tok = build_tiny_policy(cfg)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    seen = []
    check = L.check_model_source
    monkeypatch.setattr(L, "check_model_source", lambda path, allow_network=False: (seen.append(allow_network),
                                                                                     check(path, allow_network))[1])
    from rlhf.trainer import dist as D

    D.init_distributed(torch.device("cpu"))
    P.build_trainer(cfg, derive_sizes(cfg, 1), str(tmp_path / "m"), torch.device("cpu"))
    assert len(seen) == 3 and all(seen)  # actor, critic, reference
    assert L.load_options(cfg.model) == {"trust_remote_code": False, "allow_network": True}
