"""LoRA against full fine-tuning on one H200, in one table, computed from the raw results files.

    python benchmarks/lora_h200_summary.py   # writes benchmarks/results/lora_h200_summary.json

Inputs (each written on the H200 by `bash benchmarks/vllm_h200.sh scale OUT SHAPE RANK DRIVER ROUNDS`,
that is `benchmarks/real_scale.py --shape SHAPE --lora-rank RANK --drivers DRIVER --rounds ROUNDS`):
real_scale_7b_lora64_{in_process,colocated}_h200.json and real_scale_1.5b_lora{0,64}_in_process_h200.json.
Each row: rounds, mean wall and compute per round from round 2 (round 1 builds the engines'
caches), wall / compute, the update's seconds and MFU (6N FLOPs a token for full weights, 4N
with LoRA: the frozen weights get no weight gradient), the largest `torch.cuda.max_memory_allocated`,
the checkpoint's size on disk and the longest checkpoint stall.
"""

from __future__ import annotations

import json
from pathlib import Path

R = Path(__file__).resolve().parent / "results"
COMPUTE = ("timing_s/gen", "timing_s/reward", "timing_s/update", "timing_s/testing")
RUNS = {"7b_lora64_in_process": ("7b", 64, "in_process"), "7b_lora64_colocated": ("7b", 64, "colocated"),
        "1.5b_full_in_process": ("1.5b", 0, "in_process"), "1.5b_lora64_in_process": ("1.5b", 64, "in_process")}


def row(shape: str, rank: int, driver: str) -> dict:
    d = json.loads((R / f"real_scale_{shape}_lora{rank}_{driver}_h200.json").read_text())
    sec = d[driver]
    per = sec.get("per_round") or sec["partial"]
    rs = per[1:]  # from round 2
    wall = sum(r["wall_s"] for r in rs)
    comp = sum(sum(r["parts_s"].get(k, 0.0) for k in COMPUTE) for r in rs)
    out = {"shape": shape, "lora_rank": rank, "driver": driver, "rounds": len(per), "command": d["command"],
           "wall_mean_s": wall / len(rs), "compute_mean_s": comp / len(rs), "wall_over_compute": wall / comp,
           "gen_mean_s": sum(r["parts_s"]["timing_s/gen"] for r in rs) / len(rs),
           "update_mean_s": sum(r["parts_s"]["timing_s/update"] for r in rs) / len(rs),
           "max_memory_allocated_gib": sec.get("max_memory_allocated_gb"),
           "checkpoint_stall_max_s": max(r["checkpoint_stall_s"] for r in per)}
    if "update_mfu" in sec:
        out["update_mfu"] = {k: sec["update_mfu"][k] for k in ("mfu_actor", "mfu_critic")}
    if "checkpoint_bytes" in sec:
        out["checkpoint_gb"] = sec["checkpoint_bytes"] / 1e9
    return out


def main() -> None:
    rows = {name: row(*spec) for name, spec in RUNS.items() if (R / "real_scale_{}_lora{}_{}_h200.json".format(
        *spec)).exists()}
    full, lora = rows.get("1.5b_full_in_process"), rows.get("1.5b_lora64_in_process")
    out = {"benchmark": "PPO rounds with LoRA (rank 64, alpha 128, all linear layers of actor and critic) against "
                        "full fine-tuning, one H200; workload of benchmarks/real_scale.py (64 prompts x 4, prompts "
                        "<= 512, responses 256, 2 PPO epochs, validation every round, save_freq 5)",
           "machine": json.loads((R / "real_scale_7b_lora64_in_process_h200.json").read_text())["environment"],
           "rows": rows, "target": "7B round at most 1.15x its compute"}
    if full and lora:
        out["lora_over_full_1.5b"] = {k: lora[k] / full[k] for k in ("wall_mean_s", "update_mean_s", "gen_mean_s",
                                                                      "max_memory_allocated_gib", "checkpoint_gb")}
    (R / "lora_h200_summary.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, r in rows.items():
        print(f"{name:24s} {r['wall_mean_s']:6.1f} s/round  wall/compute {r['wall_over_compute']:.3f}  "
              f"peak {r['max_memory_allocated_gib']:.1f} GiB  ckpt {r.get('checkpoint_gb', float('nan')):.2f} GB  "
              f"mfu {r.get('update_mfu', {}).get('mfu_actor', float('nan')):.3f}")
    if "lora_over_full_1.5b" in out:
        print("1.5B LoRA / full:", {k: round(v, 3) for k, v in out["lora_over_full_1.5b"].items()})


if __name__ == "__main__":
    main()
