"""The largest Qwen2.5-shaped model whose PPO round update runs on one GPU, with ZeRO-3 and
with ZeRO-3 + CPU offload (optimizer states and parameters).

Each (size, mode) runs `update_throughput.py --variant packed` in its own process: actor +
critic + frozen reference built from the config (random init, bf16), one step of every
update stage (old log-probs, reference, values, advantages, critic and actor updates) on a
small batch, recording pass/fail, the error, and the peak allocated memory of each stage.
Sizes run in increasing order per mode, and a mode stops at its first failure (a larger
model needs more of every kind of memory). Generation is not part of it: with ZeRO-3 the
rollout engine (vLLM) holds its own copy of the weights.

Offload uses DeepSpeed's CPU Adam (a C++ op built just in time on first use); where that
build fails, torch's AdamW on the CPU master weights is used instead, and the result says so.

    python benchmarks/largest_model.py --out benchmarks/results/largest_model_h200.json
    python benchmarks/largest_model.py --tiny --sizes tiny   # CPU-sized check of the driver
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gpu_common as G  # noqa: E402

MODES = {
    "zero3": ["--zero", "3"],
    "zero3_offload": ["--zero", "3", "--override", "deepspeed.offload=true"],
}
BATCH = ["--prompts", "8", "--rollout-n", "2", "--max-prompt", "256", "--max-response", "256", "--mini", "8",
         "--micro", "4", "--max-tokens", "4096", "--warmup", "0", "--steps", "1"]


def torch_adam_offload() -> str:
    """DeepSpeed config that offloads with torch's AdamW instead of the CPU Adam op."""
    return json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "weight_decay": 0.0, "betas": [0.9, 0.999],
                                                                  "eps": 1e-8, "torch_adam": True}},
                       "zero_force_ds_cpu_optimizer": False})


def build_cpu_adam(timeout: int) -> dict:
    """JIT-build (or load) DeepSpeed's CPU Adam op in a child process; its time and outcome."""
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('ok')"
    t = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
        ok, log = p.returncode == 0 and "ok" in p.stdout, (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        ok, log = False, f"timeout after {timeout} s"
    return {"ok": ok, "seconds": time.time() - t, "log_tail": "" if ok else log}


def run_one(size: str, mode: str, extra: list[str], timeout: int, tiny: bool) -> dict:
    out = Path(tempfile.mkdtemp()) / "r.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/update_throughput.py"), "--variant", "packed", "--model", size,
           "--out", str(out)] + BATCH + MODES[mode] + extra + (["--tiny"] if tiny else [])
    t = time.time()
    try:
        p = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-2500:]
    except subprocess.TimeoutExpired as e:
        rc, tail = f"timeout after {timeout} s", str(e.stdout or "")[-1500:]
    res = json.loads(out.read_text()) if out.exists() else {}
    ok = bool(res) and "error" not in res and "stage_time_s" in res
    row = {"size": size, "mode": mode, "passed": ok, "wall_s": time.time() - t, "returncode": rc,
           "n_params_actor": res.get("n_params_actor"), "n_params_critic": res.get("n_params_critic"),
           "stage_peak_allocated_gb": res.get("stage_peak_allocated_gb"),
           "peak_gb_reserved": res.get("peak_gb_process"), "stage_time_s": res.get("stage_time_s"),
           "tokens_per_s": res.get("tokens_per_s")}
    if not ok:
        row["error"] = (res.get("error") or "")[:1500] or tail
    print(json.dumps({k: row[k] for k in ("size", "mode", "passed", "wall_s", "peak_gb_reserved")}), flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1.5b,3b,7b,14b")
    p.add_argument("--modes", default="zero3,zero3_offload")
    p.add_argument("--offload-from", default="", help="first size tried with offload (default: the smallest)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per (size, mode)")
    p.add_argument("--budget", type=float, default=1e9, help="seconds; no new run starts after this")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default="benchmarks/results/largest_model.json")
    a = p.parse_args(argv)
    t0 = time.time()
    sizes = [s for s in a.sizes.split(",") if s]
    result: dict = {"benchmark": "largest_model", "env": G.environment(G.pick_device(a.tiny)), "batch": BATCH,
                    "modes": {m: " ".join(MODES[m]) for m in MODES}, "runs": [], "largest": {}}
    try:
        import psutil

        result["host_memory_gb"] = psutil.virtual_memory().total / 2**30
    except ImportError:
        pass
    extra_offload: list[str] = []
    if "zero3_offload" in a.modes and not a.tiny:
        result["cpu_adam_build"] = build_cpu_adam(timeout=240)
        if not result["cpu_adam_build"]["ok"]:
            extra_offload = ["--ds-json", torch_adam_offload()]
    result["offload_optimizer"] = "torch AdamW on CPU" if extra_offload else "DeepSpeedCPUAdam"
    for mode in [m for m in a.modes.split(",") if m]:
        todo = sizes[sizes.index(a.offload_from):] if mode == "zero3_offload" and a.offload_from else sizes
        for size in todo:
            if time.time() - t0 > a.budget:
                result["runs"].append({"size": size, "mode": mode, "passed": None, "error": "not run: out of time"})
                break
            row = run_one(size, mode, extra_offload if mode == "zero3_offload" else [], a.timeout, a.tiny)
            result["runs"].append(row)
            if row["passed"]:
                result["largest"][mode] = size
            G.write_json(a.out, {**result, "wall_s": time.time() - t0})
            if not row["passed"]:
                break
    G.write_json(a.out, {**result, "wall_s": time.time() - t0})
    print(json.dumps(result["largest"]))


if __name__ == "__main__":
    main()
