"""Does RL earn its place? PPO's gain against more SFT for the same wall time.

For each seed: build the SFT-warm-started tiny policy (the default run's start: SFT on the
small labeled set until it fits it), then run side by side, one CPU thread each, from that
same start:
  (a) PPO with the rule reward on fresh unlabeled prompts for the configured rounds;
  (b) continued SFT on the same small labeled set, at the warm-start's learning rate, in a
      second process that stops the moment (a) ends, so both get the same wall time on the
      same (equally loaded) machine;
and report greedy validation accuracy of the start, (a) and (b).

    python benchmarks/ppo_vs_sft.py [--seeds 0 1 2] [key=value ...]

Writes benchmarks/results/ppo_vs_sft.json with the machine, command and figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import replace as dc_replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def continue_sft(cfg, base_dir: str, seed: int, stop, started, result) -> None:
    """Child process: SFT on the labeled split from `base_dir` until `stop` is set, then greedy val."""
    torch.set_num_threads(1)
    from rlhf.round import stages
    from rlhf.round.evaluate import evaluate_greedy
    from rlhf.trainer.default_policy import sft_targets
    from rlhf.models.load import load_causal_lm, load_tokenizer
    from rlhf.trainer.sft import sft_warm_start
    from rlhf.rollout.hf import HFRolloutEngine

    data = stages.prepare_data(cfg)
    model, tok = load_causal_lm(base_dir), load_tokenizer(base_dir)
    # The warm-start's schedule continued: same learning rate, no probe stop, no step cap.
    sft_cfg = dc_replace(cfg.model.sft, max_seconds=float("inf"), max_steps=0, epochs=10**6, warmup_steps=0,
                         stop_at_accuracy=0.0, num_threads=1)
    started.set()
    m = sft_warm_start(model, tok, data.sft["prompt"].tolist(), sft_targets(data.sft), sft_cfg, seed=seed + 1,
                       progress=False, should_stop=stop.is_set)
    engine = HFRolloutEngine(model, tok, batch_size=cfg.rollout.generate_batch_size)
    val = evaluate_greedy(engine, tok, data.val, cfg.data.max_prompt_length, cfg.data.max_response_length,
                          cfg.reward)
    result.put({"val/accuracy": val["val/accuracy"], "sft/steps": m["sft/steps"], "sft/seconds": m["sft/seconds"]})


def one_seed(seed: int, overrides: list[str], out_root: Path) -> dict:
    from rlhf.round import stages
    from rlhf.round.policy import prepare_policy
    from rlhf.config import load_config
    from rlhf.train import train

    out = out_root / f"seed{seed}"
    cfg = load_config(None, [f"trainer.seed={seed}", f"trainer.output_dir={out}", "trainer.resume=disable",
                             "trainer.logger=[console]"] + overrides)
    if (out / "base_model").exists():
        import shutil

        shutil.rmtree(out / "base_model")
    # The process set-up `rlhf.train` makes before it builds the policy (threads, global seed), so the
    # warm-start here is the one the default run gets.
    if cfg.trainer.num_threads > 0:
        torch.set_num_threads(cfg.trainer.num_threads)
    torch.manual_seed(cfg.trainer.seed)
    t0 = time.perf_counter()
    base = prepare_policy(cfg, str(out), stages.prepare_data(cfg))  # SFT warm-start, cached for train()
    sft_meta = json.loads((Path(base) / "sft_metrics.json").read_text())
    ctx = mp.get_context("spawn")
    stop, started, result = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=continue_sft, args=(cfg, base, seed, stop, started, result), daemon=True)
    child.start()
    started.wait(timeout=300)
    t1 = time.perf_counter()
    ppo = train(cfg)
    ppo_seconds = time.perf_counter() - t1
    stop.set()
    sft = result.get(timeout=1800)
    child.join(timeout=60)
    return {
        "seed": seed,
        "start_accuracy": ppo["val_score_start"],
        "ppo_accuracy_end": ppo["val_score_end"],
        "ppo_accuracy_best": ppo["val_score_best"],
        "ppo_gain": ppo["val_score_end"] - ppo["val_score_start"],
        "ppo_seconds": ppo_seconds,
        "sft_warm_start_seconds": sft_meta.get("sft/seconds"),
        "sft_warm_start_steps": sft_meta.get("sft/steps"),
        "sft_warm_start_train_accuracy": sft_meta.get("sft/probe_accuracy"),
        "total_seconds_incl_sft": t1 - t0 + ppo_seconds,
        "more_sft_accuracy": sft["val/accuracy"],
        "more_sft_gain": sft["val/accuracy"] - ppo["val_score_start"],
        "more_sft_steps": sft["sft/steps"],
        "more_sft_seconds": sft["sft/seconds"],
        "val_curve": [(h["step"], h["score"]) for h in ppo["val_history"]],
        "stop_reason": ppo["stop_reason"],
    }


def run_seeds_in_parallel(args) -> list[dict]:
    """Each seed in its own `--seeds S` subprocess (at most `--jobs` at once); their rows, in seed order."""
    import subprocess

    pending, running, rows = list(args.seeds), [], {}
    while pending or running:
        while pending and len(running) < args.jobs:
            seed = pending.pop(0)
            part = Path(args.out) / f"seed{seed}.json"
            cmd = [sys.executable, __file__, "--seeds", str(seed), "--out", args.out, "--result", str(part),
                   *args.overrides]
            running.append((seed, part, subprocess.Popen(cmd)))
        time.sleep(2)
        for item in [r for r in running if r[2].poll() is not None]:
            running.remove(item)
            seed, part, proc = item
            if proc.returncode != 0:
                raise SystemExit(f"seed {seed} failed (exit {proc.returncode}); see its output above")
            rows[seed] = json.loads(part.read_text())["seeds"][0]
    return [rows[s] for s in args.seeds]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_ppo_vs_sft"))
    p.add_argument("--result", default=str(ROOT / "benchmarks" / "results" / "ppo_vs_sft.json"))
    p.add_argument("--jobs", type=int, default=1, help="seeds run at once, each in its own process pair")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.jobs > 1 and len(args.seeds) > 1:
        rows = run_seeds_in_parallel(args)
    else:
        rows = [one_seed(s, args.overrides, Path(args.out)) for s in args.seeds]
    result = {
        "benchmark": "ppo_vs_sft",
        "command": " ".join(["python"] + sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch": torch.__version__},
        "method": "per seed: SFT warm-start, then PPO and continued SFT side by side (one thread each) "
                  "for the same wall time from the same start",
        "overrides": args.overrides,
        "seeds": rows,
        "mean_ppo_gain": sum(r["ppo_gain"] for r in rows) / len(rows),
        "mean_more_sft_gain": sum(r["more_sft_gain"] for r in rows) / len(rows),
        "ppo_beats_sft_all_seeds": all(r["ppo_accuracy_end"] > r["more_sft_accuracy"] for r in rows),
        "ppo_gain_at_least_0.15_all_seeds": all(r["ppo_gain"] >= 0.15 for r in rows),
        "start_between_0.2_and_0.6_all_seeds": all(0.2 <= r["start_accuracy"] <= 0.6 for r in rows),
        "total_under_15_min_all_seeds": all(r["total_seconds_incl_sft"] < 900 for r in rows),
    }
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "seeds"}, indent=2))
    for r in rows:
        print(f"seed {r['seed']}: start {r['start_accuracy']:.3f} ppo {r['ppo_accuracy_end']:.3f} "
              f"(+{r['ppo_gain']:.3f} in {r['ppo_seconds']:.0f}s) more-sft {r['more_sft_accuracy']:.3f} "
              f"({r['more_sft_steps']} steps); total incl. warm-start {r['total_seconds_incl_sft']:.0f}s")


if __name__ == "__main__":
    main()
