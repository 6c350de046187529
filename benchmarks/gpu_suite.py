"""The GPU benchmarks as two batched runs, writing results and logs into one folder.

    python benchmarks/gpu_suite.py single --out DIR   # GPU 0: update variants; GPU 1: rollout, then more update
    python benchmarks/gpu_suite.py multi --out DIR    # both GPUs: torchrun ZeRO-2 / ZeRO-3, reference config
    python benchmarks/gpu_suite.py balanced --out DIR # rollout + 1-GPU update, then 2 GPUs balanced vs contiguous

`single` needs one GPU (runs its two lanes one after the other) or two (side by side, one
process per GPU: they share no device). Every lane has a deadline so that whatever
finished is written before the run's limit.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TINY: list[str] = []  # ["--tiny"]: the same runs CPU-sized
# The update benchmark on two ranks of this host (torchrun).
TWO_RANKS = [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-endpoint=127.0.0.1:29500",
             "benchmarks/update_throughput.py"]
ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "DS_ACCELERATOR": "cuda", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
       "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # variable micro-batch shapes fragment the cache


def lane(cmds: list[tuple[list[str], int]], gpus: str, log: Path, deadline: float) -> subprocess.Popen:
    """Run commands one after another in the background on `gpus`, each cut at its own
    timeout or at the deadline, all output appended to `log`."""
    script = []
    for cmd, timeout in cmds:
        cmd = cmd + TINY
        script.append(f"left=$(( {int(deadline)} - $(date +%s) )); t=$(( left < {timeout} ? left : {timeout} )); "
                      f"if [ $t -gt 20 ]; then echo {shlex.quote('>>> ' + shlex.join(cmd))}; "
                      f"timeout -k 10 $t {shlex.join(cmd)}; echo \"<<< rc=$?\"; fi")
    env = {**os.environ, **ENV, "CUDA_VISIBLE_DEVICES": gpus}
    if TINY:
        env.pop("DS_ACCELERATOR")
    return subprocess.Popen(["bash", "-c", "; ".join(script)], cwd=ROOT, env=env, stdout=open(log, "a"),
                            stderr=subprocess.STDOUT)


def side_by_side(gpu0: list, gpu1: list, out: Path, deadline: float, fall_back: bool = True) -> None:
    """The two lanes at once, on GPU 0 and GPU 1 (logs gpu0.log, gpu1.log), and wait for both;
    with `fall_back` and one visible GPU, one after the other on GPU 0."""
    import torch

    if fall_back and torch.cuda.device_count() < 2:
        procs = [lane(gpu0 + gpu1, "0", out / "gpu0.log", deadline)]
    else:
        procs = [lane(gpu0, "0", out / "gpu0.log", deadline), lane(gpu1, "1", out / "gpu1.log", deadline)]
    for p in procs:
        p.wait()


def single(out: Path, budget: float) -> None:
    deadline = time.time() + budget
    ub = [PY, "benchmarks/update_throughput.py"]
    gpu0 = [(ub + ["--variants", "check,packed,padded,grpo_packed,trl", "--timeout", "220",
                   "--out", str(out / "update_1gpu_h200.json")], 10**4)]
    gpu1 = [([PY, "benchmarks/rollout_throughput.py", "--out", str(out / "rollout_h200.json")], 330),
            (ub + ["--variants", "packed_ckpt,grpo_padded", "--timeout", "200",
                   "--out", str(out / "update_1gpu_extra_h200.json")], 10**4)]
    side_by_side(gpu0, gpu1, out, deadline)


def multi(out: Path, budget: float) -> None:
    deadline = time.time() + budget
    tr = TWO_RANKS
    ref_args = subprocess.run([PY, "benchmarks/gpu_reference_config.py", "--gpus", "2"], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, **ENV}).stdout.split()
    cmds = [
        (tr + ["--variant", "packed", "--zero", "2", "--out", str(out / "update_2gpu_zero2_h200.json")], 170),
        (tr + ref_args + ["--warmup", "1", "--steps", "1", "--out", str(out / "reference_config_2gpu_h200.json")],
         200),
        (tr + ["--variant", "packed", "--zero", "3", "--steps", "1", "--out", str(out / "update_2gpu_zero3_h200.json")],
         200),
    ]
    lane(cmds, "0,1", out / "multi.log", deadline).wait()


def final(out: Path, budget: float) -> None:
    """Re-measure the single-GPU update with the allocator's expandable segments (two lanes,
    one per GPU), plain `generate` on the rollout workload, then the two-GPU runs."""
    t0 = time.time()
    ub = [PY, "benchmarks/update_throughput.py"]
    gpu0 = [(ub + ["--variants", "packed,grpo_packed,padded", "--timeout", "150", "--warmup", "1", "--steps", "1",
                   "--out", str(out / "update_1gpu_expandable_h200.json")], 10**4)]
    gpu1 = [(ub + ["--variants", "attn_check", "--out", str(out / "attn_check_h200.json")], 60),
            ([PY, "benchmarks/rollout_throughput.py", "--engines", "generate", "--out",
              str(out / "rollout_generate_h200.json")], 200)]
    phase_a = t0 + 0.42 * budget
    procs = [lane(gpu0, "0", out / "lanes.log", phase_a), lane(gpu1, "1", out / "lanes.log", phase_a)]
    for p in procs:
        p.wait()
    multi(out, budget - (time.time() - t0))


def diagnose(out: Path, budget: float) -> None:
    """GPU 0: one update step of the packed path under the profiler, the plain-PyTorch
    control, and the engine settings the trace may point at; GPU 1: the largest model that
    runs a round with ZeRO-3, and with ZeRO-3 + CPU offload."""
    deadline = time.time() + budget
    ub = [PY, "benchmarks/update_throughput.py", "--warmup", "1", "--steps", "1"]
    fp32_acc = '{"data_types": {"grad_accum_dtype": "fp32"}}'
    gpu0 = [(ub + ["--variants", "packed", "--profile-dir", str(out / "profile"),
                   "--out", str(out / "update_profile_h200.json")], 200),
            (ub + ["--variants", "raw_bf16,raw_master", "--out", str(out / "update_raw_h200.json")], 150),
            (ub + ["--variants", "packed", "--zero", "1", "--out", str(out / "update_zero1_h200.json")], 100),
            (ub + ["--variants", "packed", "--zero", "1", "--ds-json", fp32_acc,
                   "--out", str(out / "update_zero1_fp32acc_h200.json")], 100),
            (ub + ["--variants", "packed", "--max-tokens", "32768", "--out", str(out / "update_32k_h200.json")], 100)]
    gpu1 = [([PY, "benchmarks/largest_model.py", "--timeout", "220", "--budget", str(int(budget - 150)),
              "--out", str(out / "largest_model_h200.json")], 10**4)]
    side_by_side(gpu0, gpu1, out, deadline)


def fixed(out: Path, budget: float) -> None:
    """After the trace: GPU 0 measures ours (packed, profiled; GRPO; padded) and TRL side by
    side; GPU 1 attributes the gain (DeepSpeed's own bf16 wrapper; ZeRO-1 with float32
    accumulation) and tries a larger token budget with activation checkpointing; then both
    GPUs run the update on the same global batch with ZeRO-2 and with ZeRO-0 (MasterAdamW,
    gradients all-reduced once per optimizer step)."""
    t0 = time.time()
    ub = [PY, "benchmarks/update_throughput.py"]
    fp32_acc = '{"data_types": {"grad_accum_dtype": "fp32"}}'
    gpu0 = [(ub + ["--variants", "packed", "--profile-dir", str(out / "profile"),
                   "--out", str(out / "update_1gpu_packed_h200.json")], 150),
            (ub + ["--variants", "grpo_packed,trl", "--timeout", "120",
                   "--out", str(out / "update_1gpu_h200.json")], 240),
            (ub + ["--variants", "padded", "--warmup", "1", "--steps", "1",
                   "--out", str(out / "update_1gpu_padded_h200.json")], 120)]
    one = ["--warmup", "1", "--steps", "1"]
    gpu1 = [(ub + one + ["--variants", "packed", "--ds-bf16-wrapper",
                         "--out", str(out / "update_1gpu_ds_bf16_wrapper_h200.json")], 90),
            (ub + one + ["--variants", "packed", "--zero", "1", "--ds-json", fp32_acc,
                         "--out", str(out / "update_1gpu_zero1_fp32acc_h200.json")], 90),
            (ub + one + ["--variants", "packed_ckpt", "--max-tokens", "32768",
                         "--out", str(out / "update_1gpu_ckpt_32k_h200.json")], 100)]
    phase_a = t0 + 0.62 * budget
    side_by_side(gpu0, gpu1, out, phase_a, fall_back=False)
    deadline = t0 + budget
    tr = [*TWO_RANKS, "--warmup", "1", "--steps", "1"]
    lane([(tr + ["--variant", "packed", "--zero", "2", "--out", str(out / "update_2gpu_zero2_h200.json")], 110),
          (tr + ["--variant", "packed", "--zero", "0", "--out", str(out / "update_2gpu_zero0_h200.json")], 110)],
         "0,1", out / "multi.log", deadline).wait()


def epochs1(out: Path, budget: float) -> None:
    """The same work as TRL's step (one pass over the batch, `--epochs 1`): first both GPUs
    (ZeRO-2, and ZeRO-0 with MasterAdamW), then GPU 0 measures ours (packed, profiled; GRPO;
    padded) and TRL side by side while GPU 1 runs the 7B model with ZeRO-3 + CPU offload."""
    t0 = time.time()
    tr = [*TWO_RANKS, "--warmup", "1", "--steps", "2"]
    lane([(tr + ["--variant", "packed", "--zero", "2", "--out", str(out / "update_2gpu_zero2_h200.json")], 90),
          (tr + ["--variant", "packed", "--zero", "0", "--out", str(out / "update_2gpu_zero0_h200.json")], 90)],
         "0,1", out / "multi.log", t0 + 200).wait()
    deadline = t0 + budget
    ub = [PY, "benchmarks/update_throughput.py"]
    gpu0 = [(ub + ["--variants", "packed", "--profile-dir", str(out / "profile"),
                   "--out", str(out / "update_1gpu_packed_h200.json")], 120),
            (ub + ["--variants", "grpo_packed,trl", "--timeout", "100",
                   "--out", str(out / "update_1gpu_h200.json")], 200),
            (ub + ["--variants", "padded", "--warmup", "1", "--steps", "1",
                   "--out", str(out / "update_1gpu_padded_h200.json")], 100)]
    gpu1 = [([PY, "benchmarks/largest_model.py", "--modes", "zero3_offload", "--sizes", "7b", "--timeout", "280",
              "--out", str(out / "largest_model_offload_h200.json")], 10**4)]
    side_by_side(gpu0, gpu1, out, deadline, fall_back=False)


def balanced(out: Path, budget: float) -> None:
    """GPU 0 measures the one-GPU update (packed, one pass) while GPU 1 runs the rollout
    benchmark; then both GPUs run the same global batch with ZeRO-0 split by token count
    (`trainer.balance_batch`, the default), split contiguously, and with ZeRO-2 balanced."""
    t0 = time.time()
    ub = [PY, "benchmarks/update_throughput.py"]
    gpu0 = [(ub + ["--variants", "packed", "--warmup", "1", "--steps", "2",
                   "--out", str(out / "update_1gpu_packed_h200.json")], 200)]
    gpu1 = [([PY, "benchmarks/rollout_throughput.py", "--out", str(out / "rollout_h200.json")], 280)]
    side_by_side(gpu0, gpu1, out, t0 + 0.52 * budget, fall_back=False)
    tr = [*TWO_RANKS, "--warmup", "1", "--steps", "2", "--variant", "packed"]
    lane([(tr + ["--zero", "0", "--out", str(out / "update_2gpu_zero0_balanced_h200.json")], 90),
          (tr + ["--zero", "0", "--override", "trainer.balance_batch=false",
                 "--out", str(out / "update_2gpu_zero0_contiguous_h200.json")], 90),
          (tr + ["--zero", "2", "--out", str(out / "update_2gpu_zero2_balanced_h200.json")], 90)],
         "0,1", out / "multi.log", t0 + budget).wait()


def report(out: Path) -> None:
    """One line per results file: the summary, or each variant's tokens/s, MFU and error."""
    import json

    for f in sorted(out.glob("*.json")):
        d = json.loads(f.read_text())
        if "variants" in d:
            for k, v in d["variants"].items():
                t = v.get("stage_time_s", {})
                print(f"{f.name}:{k} tok/s={v.get('tokens_per_s', 0):.0f} mfu_actor={v.get('mfu_actor') or 0:.3f} "
                      f"stages={ {s: round(x, 2) for s, x in t.items()} } err={v.get('error', '')[:300]}")
        elif "engines" in d:
            print(f"{f.name}: agreement={json.dumps(d.get('agreement_greedy'))[:400]}")
            for k, v in d["engines"].items():
                print(f"{f.name}:{k} tok/s={v.get('tokens_per_s', 0):.0f} decode_roofline_frac="
                      f"{v.get('decode_fraction_of_roofline')} stats={ {a: b for a, b in v.items() if a.startswith('engine_')} }"
                      f" err={v.get('error', '')[:300]}")
        else:
            keys = ("world_size", "tokens_per_s", "mfu_actor", "stage_time_s", "peak_gb_reserved_per_rank", "error")
            print(f"{f.name}: " + json.dumps({k: d[k] for k in keys if k in d})[:900])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("what", choices=("single", "multi", "final", "diagnose", "fixed", "epochs1", "balanced", "report"))
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_suite"))
    p.add_argument("--budget", type=float, default=560.0, help="seconds until every lane stops")
    p.add_argument("--tiny", action="store_true", help="CPU-sized commands, to check the suite itself")
    a = p.parse_args(argv)
    TINY[:] = ["--tiny"] if a.tiny else []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.what == "report":
        return report(out)
    suites = {"single": single, "multi": multi, "final": final, "diagnose": diagnose, "fixed": fixed,
              "epochs1": epochs1, "balanced": balanced}
    suites[a.what](out, a.budget)
    report(out)


if __name__ == "__main__":
    main()
