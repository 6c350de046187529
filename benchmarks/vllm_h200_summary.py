"""The vLLM measurements on one H200 in one table, computed from the raw results files.

    python benchmarks/vllm_h200_summary.py   # writes benchmarks/results/vllm_h200_summary.json

Inputs (each written on the H200 by `bash benchmarks/vllm_h200.sh STEP OUT`):
rollout_vllm_vs_fast_h200.json (throughput), real_scale_vllm_{in_process,colocated}_h200.json
(rounds), vllm_mismatch_smollm2_h200.json (mismatch). A driver section that holds only
`partial` (the call's time limit cut the process after its last round, before its closing
flush) is summarised from the rounds it recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).resolve().parent / "results"
COMPUTE = ("timing_s/gen", "timing_s/reward", "timing_s/update", "timing_s/testing")
CORR = ("rollout_corr/log_ppl_abs_diff", "rollout_corr/log_ppl_diff_max", "rollout_corr/kl", "rollout_corr/k3_kl",
        "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min",
        "rollout_corr/rollout_rs_masked_fraction", "training/rollout_probs_diff_mean",
        "training/rollout_probs_diff_max")


def rounds(name: str) -> dict:
    d = json.loads((R / f"real_scale_vllm_{name}_h200.json").read_text())[name]
    per = d.get("per_round") or d["partial"]
    out = {"rounds": len(per), "complete": "per_round" in d}
    for first in (1, 2):  # round 1 includes vLLM's torch.compile and CUDA-graph capture
        rs = per[first - 1:]
        wall = sum(r["wall_s"] for r in rs)
        comp = sum(sum(r["parts_s"].get(k, 0.0) for k in COMPUTE) for r in rs)
        out[f"from_round_{first}"] = {"wall_mean_s": wall / len(rs), "wall_over_compute": wall / comp,
                                      "gen_mean_s": sum(r["parts_s"]["timing_s/gen"] for r in rs) / len(rs),
                                      "update_mean_s": sum(r["parts_s"]["timing_s/update"] for r in rs) / len(rs)}
    pushes = [r["parts_s"].get("timing_s/update_weights", 0.0) for r in per]
    out["weight_push_s"] = {"mean": sum(pushes) / len(pushes), "max": max(pushes)}
    out["checkpoint_stall_max_s"] = max(r["checkpoint_stall_s"] for r in per)
    out["mismatch_last_round"] = {k: v for k, v in per[-1].get("rollout_corr", {}).items() if k in CORR}
    if "update_mfu" in d:
        out["update_mfu"] = {k: d["update_mfu"][k] for k in ("mfu_actor", "mfu_critic") if k in d["update_mfu"]}
    return out


def main() -> dict:
    thr = json.loads((R / "rollout_vllm_vs_fast_h200.json").read_text())
    mm = json.loads((R / "vllm_mismatch_smollm2_h200.json").read_text())
    eng = thr["engines"]
    res = {
        "machine": thr["env"],
        "commands": ["bash benchmarks/vllm_h200.sh throughput OUT",
                     "ROUNDS_TIMEOUT=330 bash benchmarks/vllm_h200.sh rounds OUT in_process",
                     "ROUNDS_TIMEOUT=400 bash benchmarks/vllm_h200.sh rounds OUT colocated",
                     "bash benchmarks/vllm_h200.sh mismatch OUT"],
        "throughput_1_5b": {"workload": thr["workload"],
                            "tokens_per_s": {k: eng[k]["tokens_per_s"] for k in ("vllm", "fast")},
                            "fast_over_vllm": eng["fast"]["tokens_per_s"] / eng["vllm"]["tokens_per_s"],
                            "vllm_engine_startup_s": eng["vllm"]["engine_startup_s"],
                            "mismatch_vllm_vs_trainer": {k: v for k, v in eng["vllm"]["mismatch"].items() if k in CORR}},
        "rounds_1_5b_vllm": {name: rounds(name) for name in ("in_process", "colocated")},
        "mismatch_smollm2": {"engine": "vLLM 0.26.0 compiled (torch.compile + CUDA graphs), bf16",
                             "response_len_mean": mm["response_len_mean"],
                             **{k: v for k, v in mm["mismatch"].items() if k in CORR or "rollout_rs" in k
                                and k.endswith(("masked_fraction", "_max", "_min"))}},
    }
    ref = json.loads((R / "real_scale_h200.json").read_text())["colocated"]
    per = ref["per_round"][1:]
    res["rounds_1_5b_hf_fast_reference"] = {
        "file": "real_scale_h200.json colocated (same workload with hf_fast, an earlier call)",
        "from_round_2": {"wall_mean_s": sum(r["wall_s"] for r in per) / len(per),
                         "gen_mean_s": sum(r["parts_s"]["timing_s/gen"] for r in per) / len(per),
                         "update_mean_s": sum(r["parts_s"]["timing_s/update"] for r in per) / len(per)}}
    (R / "vllm_h200_summary.json").write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
