"""The example configs load and split as documented; the config reference is current."""

from pathlib import Path

import pytest

from rlhf.config import derive_sizes, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_gsm8k_one_gpu_example():
    cfg = load_config(ROOT / "examples" / "gsm8k_qwen2.5-0.5b_1gpu.yaml")
    s = derive_sizes(cfg)
    assert (s.world_size, s.responses_per_step, s.num_mini_batches, s.mini_batch_per_gpu) == (1, 256, 4, 64)
    assert cfg.rollout.name == "vllm" and cfg.data.prompt_format == "chat" and cfg.deepspeed.bf16


def test_eight_gpu_example():
    cfg = load_config(ROOT / "examples" / "8gpu_single_node.yaml")
    s = derive_sizes(cfg)
    assert s.world_size == 8 and cfg.rollout.tensor_model_parallel_size == 2 and cfg.deepspeed.zero_stage == 2
    assert s.responses_per_step == 4096 and s.responses_per_gpu == 512
    assert (s.num_mini_batches, s.mini_batch_responses, s.mini_batch_per_gpu) == (4, 1024, 128)
    assert cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu == 16384
    with pytest.raises(ValueError, match="divisible by the number of GPUs"):
        derive_sizes(load_config(ROOT / "examples" / "8gpu_single_node.yaml",
                                 ["actor.ppo_mini_batch_size=1", "rollout.n=1"]), 8)


def test_config_reference_is_current():
    from rlhf.config.doc import render

    assert (ROOT / "docs" / "CONFIG.md").read_text() == render(), "run python -m rlhf.config.doc"


def test_smollm2_one_gpu_example():
    cfg = load_config(ROOT / "examples" / "smollm2_gsm8k_1gpu.yaml")
    s = derive_sizes(cfg)
    assert (s.world_size, s.responses_per_step, s.num_mini_batches, s.mini_batch_per_gpu) == (1, 256, 4, 64)
    assert cfg.model.path.endswith(".gguf") and cfg.data.prompt_format == "chat"
    assert cfg.reward.gsm8k_method == "strict" and cfg.reward.format_score > 0


def test_smollm2_one_gpu_example_never_stops_on_kl():
    """verl does not stop GSM8K PPO on KL; the H200 run stopped at round 9 of its budget with
    per-token KL 1.1-1.2 to the warm-start (target_kl 1.0, patience 3)."""
    from rlhf.round.state import RoundState, decide

    cfg = load_config(ROOT / "examples" / "smollm2_gsm8k_1gpu.yaml")
    state, verdict = RoundState(), None
    for _ in range(50):
        state, verdict = decide(state, [{"actor/current_kl": 25.0}], cfg)
    assert not verdict.stop, verdict.reason
    state, verdict = decide(state, [{"actor/current_kl": float("nan")}], cfg)
    assert verdict.stop, "a non-finite KL still stops the run"
