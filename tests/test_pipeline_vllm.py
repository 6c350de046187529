"""The whole pipeline as a Flyte local execution with vLLM (its CPU build): every task runs in
one process, and the engine that a task closes is the one the next task gets back
(`rlhf.rollout.vllm.open_engine`), so the run builds one engine. Parking is what GPU engines
with sleep mode do; it is switched on here for the CPU build."""

from __future__ import annotations

import pytest

from rlhf.config import load_config
from test_trainer import TINY

pytestmark = pytest.mark.vllm


def test_local_execution_builds_one_vllm_engine_for_every_task(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from rlhf.rollout import vllm as V
    from workflows.ppo import ppo_pipeline

    monkeypatch.setenv("FLYTE_LOCAL_CACHE_ENABLED", "false")
    monkeypatch.setattr(V.VLLMRolloutEngine, "parks", property(lambda self: True))
    built, reused = [], []
    init, update = V.VLLMRolloutEngine.__init__, V.VLLMRolloutEngine.update_weights

    def counted_init(self, model_dir, *args, **kwargs):
        built.append(model_dir)
        init(self, model_dir, *args, **kwargs)

    def counted_update(self, model_dir):
        reused.append(model_dir)
        update(self, model_dir)

    monkeypatch.setattr(V.VLLMRolloutEngine, "__init__", counted_init)
    monkeypatch.setattr(V.VLLMRolloutEngine, "update_weights", counted_update)
    # vLLM's CPU attention needs a head size of at least 32
    cfg = load_config(None, TINY + ["rollout.name=vllm", "model.tiny.hidden_size=64", "trainer.total_rounds=2",
                                    "trainer.test_freq=1", f"trainer.output_dir={tmp_path}"])
    try:
        out = ppo_pipeline(cfg=cfg)
    finally:
        for engine in list(V._PARKED):
            engine.shutdown()
    assert out.state.round == 2
    assert len(built) == 1 and built[0].endswith("base_model"), f"engines built: {built}"
    # the segment's engine (the base policy, then weights from memory each round) and the last
    # round's validation (its checkpoint's policy) are the first validation's engine
    assert len(reused) == 2 and reused[0] == built[0] and reused[1].endswith("round_000002/actor"), reused
