"""Does the SFT warm-start reach its phase change on every seed and under perturbed numerics?

The tiny model's SFT has a sharp phase change (greedy accuracy on its training problems
jumps from near 0 to most of them within a few dozen steps), and the step where it comes
depends on floating-point details: a warm-start whose step cap sits near that step learns
on one machine and not on another. This runs a warm-start schedule over many seeds and
numeric variants that change those details the way another machine would:

  t1       one torch thread (the warm-start's default)
  t2       two torch threads (another reduction order in every matmul and reduction)
  mm_bf16  one thread, `torch.set_float32_matmul_precision("medium")` (bf16 matmuls where
           the CPU has them: a much larger perturbation than any machine difference)
  avx2     one thread, torch, MKL and oneDNN kernels held to AVX2 (the code paths of a CPU
           without AVX-512: another machine's floating-point details, on this one)

and records, per run: the steps it took, whether it stopped on its accuracy target (inside
the step cap) or on the cap, the first probe step at or above `--phase-level`, and greedy
accuracy on the held-out validation split.

    python benchmarks/sft_reliability.py --schedule default --seeds 0 1 2 3 4 5 --variants t1 t2 mm_bf16
    python benchmarks/sft_reliability.py --schedule sweep ...

Each run is its own process (`--jobs` at once, one thread each unless the variant says
otherwise). Writes benchmarks/results/sft_reliability_<schedule>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (torch threads, float32 matmul precision, environment of the run)
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
VARIANTS = {"t1": (1, "highest", {}), "t2": (2, "highest", {}), "mm_bf16": (1, "medium", {}),
            "avx2": (1, "highest", AVX2_ONLY)}
PROBE_LINE = re.compile(r"sft step (\d+) greedy accuracy on \d+ training problems ([0-9.]+)")


def schedule_overrides(name: str) -> list[str]:
    """The warm-start as the default run (`default`) or the sweep (`sweep`) configures it."""
    if name == "default":
        return []
    if name == "sweep":
        from sweeps.sweep import SHORT_SCHEDULE

        return [o for o in SHORT_SCHEDULE if o.startswith(("data.synthetic.", "model."))]
    raise SystemExit(f"--schedule {name!r}: choose default or sweep")


def one_run(seed: int, variant: str, overrides: list[str], save_dir: str = "") -> dict:
    """In this process: the warm-start for `seed` under `variant`, then greedy val; prints its probe lines."""
    import torch

    threads, precision, _ = VARIANTS[variant]
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(precision)
    from rlhf.config import load_config
    from rlhf.data.arithmetic import make_splits
    from rlhf.round.evaluate import evaluate_greedy
    from rlhf.trainer.default_policy import warm_start
    from rlhf.rollout.hf import HFRolloutEngine

    cfg = load_config(None, [f"trainer.seed={seed}", f"model.sft.num_threads={threads}", *overrides])
    torch.manual_seed(seed)  # as rlhf.train does before it builds the policy
    splits = make_splits(cfg.data.synthetic)
    model, tok, m = warm_start(cfg, splits["sft"])
    if save_dir:  # e.g. the start of benchmarks/learning_speed.py for this seed
        from rlhf.models.load import save_model_atomic

        save_model_atomic(model, tok, save_dir)
        (Path(save_dir) / "sft_metrics.json").write_text(json.dumps(m))
    torch.set_float32_matmul_precision("highest")  # validation itself unperturbed
    val = evaluate_greedy(HFRolloutEngine(model, tok, batch_size=256), tok, splits["val"],
                          cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.reward)
    sft = cfg.model.sft
    return {"steps": m["sft/steps"], "seconds": m["sft/seconds"], "train_probe_accuracy": m.get("sft/probe_accuracy"),
            "val_accuracy": val["val/accuracy"], "stop_at_accuracy": sft.stop_at_accuracy, "max_steps": sft.max_steps,
            "reached_target": m.get("sft/probe_accuracy", 0.0) >= sft.stop_at_accuracy}


def launch(seed: int, variant: str, args) -> tuple[subprocess.Popen, Path]:
    """The run as a child process whose output goes to `<logdir>/<schedule>_<seed>_<variant>.log`."""
    cmd = [sys.executable, __file__, "--one", str(seed), variant, "--schedule", args.schedule, *args.overrides]
    if args.save_dir:
        cmd[5:5] = ["--save-dir", str(Path(args.save_dir) / f"{args.schedule}_{seed}_{variant}")]
    # Passive OpenMP waits: spinning threads crawl on a CPU shared with other jobs (same arithmetic).
    env = {**os.environ, "OMP_NUM_THREADS": str(VARIANTS[variant][0]), "OMP_WAIT_POLICY": "PASSIVE",
           **VARIANTS[variant][2]}
    log = Path(args.logdir) / f"{args.schedule}_{seed}_{variant}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env), log


def parse(seed: int, variant: str, out: str, level: float) -> dict:
    """The run's JSON line plus its probe curve and the first probe step at or above `level`."""
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"seed {seed} {variant} failed:\n{out[-3000:]}")
    row = {"seed": seed, "variant": variant, **json.loads(lines[-1])}
    curve = [(int(s), float(a)) for s, a in PROBE_LINE.findall(out)]
    row["probe_curve"] = curve
    row["phase_step"] = next((s for s, a in curve if a >= level), None)
    return row


def run_all(args, write) -> list[dict]:
    """Every (seed, variant) run, `--jobs` at a time; `write(rows)` after each one ends."""
    pending = [(int(r.split(":")[0]), r.split(":")[1]) for r in args.runs] if args.runs else \
        [(s, v) for v in args.variants for s in args.seeds]
    running, rows = [], []
    while pending or running:
        while pending and len(running) < args.jobs:
            s, v = pending.pop(0)
            running.append((s, v, *launch(s, v, args)))
        s, v, proc, log = running.pop(0)
        proc.wait()
        row = parse(s, v, log.read_text(), args.phase_level)
        print(f"{args.schedule} seed {s} {v}: steps {row['steps']} phase at {row['phase_step']} "
              f"train {row['train_probe_accuracy']:.3f} val {row['val_accuracy']:.3f} "
              f"({row['seconds']:.0f}s)", flush=True)
        rows.append(row)
        write(rows)
    return rows


def rows_from_logs(args) -> list[dict]:
    """The rows of every finished run whose log is in `--logdir` (runs of earlier launches)."""
    rows = []
    for log in sorted(Path(args.logdir).glob(f"{args.schedule}_*_*.log")):
        seed, variant = log.stem.split("_", 2)[1:]
        if '"steps"' in log.read_text():
            rows.append(parse(int(seed), variant, log.read_text(), args.phase_level))
    return sorted(rows, key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"]))


def summary(rows: list[dict]) -> dict:
    import statistics as st

    vals = [r["val_accuracy"] for r in rows]
    phase = [r["phase_step"] for r in rows if r["phase_step"] is not None]
    return {"runs": len(rows), "all_reached_target_within_cap": all(r["reached_target"] for r in rows),
            "all_reached_phase_change": len(phase) == len(rows),
            "phase_step_min": min(phase, default=None), "phase_step_max": max(phase, default=None),
            "steps_min": min(r["steps"] for r in rows), "steps_max": max(r["steps"] for r in rows),
            "val_accuracy_mean": st.mean(vals), "val_accuracy_std": st.pstdev(vals),
            "val_accuracy_min": min(vals), "val_accuracy_max": max(vals)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule", default="default", help="default | sweep")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--phase-level", type=float, default=0.2,
                   help="probe accuracy that marks the phase change (before it the probe stays near 0)")
    p.add_argument("--runs", nargs="+", default=[], metavar="SEED:VARIANT",
                   help="explicit runs, in order (instead of every seed x variant)")
    p.add_argument("--save-dir", default="", help="save each warm-started policy under DIR/<schedule>_<seed>_<variant>")
    p.add_argument("--from-logs", action="store_true",
                   help="write the result from the finished runs' logs in --logdir (no new runs)")
    p.add_argument("--one", nargs=2, metavar=("SEED", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--result", default="")
    p.add_argument("--logdir", default=str(ROOT / "outputs" / "sft_reliability"), help="each run's output")
    p.add_argument("overrides", nargs="*", help="extra config overrides after the schedule's")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_run(int(args.one[0]), args.one[1], schedule_overrides(args.schedule) + args.overrides,
                                 args.save_dir)))
        return
    t0 = time.perf_counter()
    out = Path(args.result or ROOT / "benchmarks" / "results" / f"sft_reliability_{args.schedule}.json")
    if args.from_logs:
        write_result(out, args, rows_from_logs(args), wall_s=None)
    else:
        run_all(args, lambda rows: write_result(out, args, rows, time.perf_counter() - t0))
    print(out.read_text().split('"runs"')[0])


def write_result(out: Path, args, rows: list[dict], wall_s: float | None) -> None:
    import torch
    import transformers

    result = {"benchmark": "sft_reliability", "schedule": args.schedule,
              "command": " ".join(["python"] + sys.argv), "wall_s": wall_s,
              "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "transformers": transformers.__version__},
              "schedule_overrides": schedule_overrides(args.schedule), "overrides": args.overrides,
              "variants": {k: {"threads": t, "float32_matmul_precision": m, "env": e}
                           for k, (t, m, e) in VARIANTS.items()},
              "phase_level": args.phase_level, "summary": summary(rows),
              "by_variant": {v: summary([r for r in rows if r["variant"] == v])
                             for v in VARIANTS if any(r["variant"] == v for r in rows)},
              "runs": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
