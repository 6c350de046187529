"""Offline RLHF on the tiny default: PPO from rollouts an earlier run stored, with and without
rollout correction, against the online run that stored them.

For each seed, one CPU thread, in sequence:
  (a) online: the default run (SFT warm-start, then PPO) for `--rounds` rounds, each round's
      scored rollouts stored under `trainer.rollout_data_dir`;
  (b) offline: a fresh run from the same start that reads (a)'s stored table in place of
      generation (`data.rollout_files`) for `--passes` passes over it (rounds x passes
      rounds), rollout correction off (preset `disabled`);
  (c) offline + correction: the same with the default correction (token-level truncated IS
      at 2.0 against the stored behaviour log-probs).
Greedy val accuracy (`val/reward/mean`, the share answered right) before and after each.
The first pass replays (a) exactly (same data, same seeds: the behaviour policy of each
block is the offline run's own policy, so the correction weights are 1); in later passes
the data are stale (sampled by an earlier policy than the current one) and the weights
correct for that.

    python benchmarks/offline_ppo.py [--seeds 0 1 2] [--rounds 6] [--passes 2] [key=value ...]

Writes benchmarks/results/offline_ppo.json with the machine, versions, command and figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = {
    "offline": ["algorithm.rollout_correction.preset=disabled"],
    "offline_corrected": [],  # the default: rollout_is=token, rollout_is_threshold=2.0
}


class Recorder:
    """A metrics sink that keeps every logged dict (the runs log to no other sink)."""

    def __init__(self):
        self.logged: list[dict] = []

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self.logged.append(dict(metrics))

    def __getattr__(self, name):  # log_params, log_artifact, set_tags, close: nothing to do
        return lambda *a, **k: None


def run_arm(overrides: list[str]) -> dict:
    import rlhf.tracking.make
    from rlhf.config import load_config
    from rlhf.train import train

    rec = Recorder()
    make_sink, rlhf.tracking.make.make_sink = rlhf.tracking.make.make_sink, lambda *a, **k: rec
    try:
        t = time.perf_counter()
        summary = train(load_config(None, overrides))
    finally:
        rlhf.tracking.make.make_sink = make_sink
    steps = [m for m in rec.logged if "actor/pg_loss" in m]
    keys = sorted({k for m in steps for k in m if k.startswith("rollout_corr/")})
    return {"start_accuracy": summary["val_score_start"], "end_accuracy": summary["val_score_end"],
            "gain": summary["val_score_end"] - summary["val_score_start"], "rounds": summary["rounds"],
            "seconds": time.perf_counter() - t, "stop_reason": summary["stop_reason"],
            "val_curve": [[v["round"], v["score"]] for v in summary["val_history"]],
            "correction_means": {k: sum(m[k] for m in steps if k in m) / len(steps) for k in keys}}


def one_seed(seed: int, rounds: int, passes: int, overrides: list[str], root: Path) -> dict:
    common = [f"trainer.seed={seed}", "trainer.logger=[none]", "trainer.device=cpu", "trainer.num_threads=1",
              "trainer.resume=disable", *overrides]
    online = [f"trainer.total_rounds={rounds}", f"trainer.test_freq={rounds}"]
    offline = [f"trainer.total_rounds={rounds * passes}", f"trainer.test_freq={rounds}"]
    online_out = root / f"seed{seed}" / "online"
    stored = online_out / "rollouts"
    result = {"seed": seed}
    result["online"] = run_arm(common + online + [f"trainer.output_dir={online_out}",
                                                  f"trainer.rollout_data_dir={stored}"])
    base = online_out / "base_model"
    for arm, extra in ARMS.items():
        out = root / f"seed{seed}" / arm
        result[arm] = run_arm(common + offline + [f"trainer.output_dir={out}", f"model.path={base}",
                                        f"data.rollout_files={stored}", *extra])
    print(json.dumps(result), flush=True)
    return result


def machine() -> dict:
    import deepspeed
    import flytekit
    import torch
    import transformers

    return {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
            "cpus_visible": len(__import__("os").sched_getaffinity(0)), "torch": torch.__version__,
            "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
            "flytekit": flytekit.__version__, "threads_per_run": 1}


def summarize(seeds: list[dict]) -> dict:
    out = {}
    for arm in ("online", *ARMS):
        gains = [s[arm]["gain"] for s in seeds]
        out[arm] = {"mean_start": sum(s[arm]["start_accuracy"] for s in seeds) / len(seeds),
                    "mean_end": sum(s[arm]["end_accuracy"] for s in seeds) / len(seeds),
                    "mean_gain": sum(gains) / len(gains), "min_gain": min(gains),
                    "mean_seconds": sum(s[arm]["seconds"] for s in seeds) / len(seeds)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=6, help="online rounds (= stored blocks)")
    p.add_argument("--passes", type=int, default=2, help="offline passes over the stored table")
    p.add_argument("--out", default=str(ROOT / ".cache" / "bench_offline_ppo"))
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "offline_ppo.json"))
    p.add_argument("overrides", nargs="*", help="config overrides for every arm, e.g. data.synthetic.n_val=200")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    seeds = [one_seed(s, args.rounds, args.passes, args.overrides, Path(args.out)) for s in args.seeds]
    report = {"benchmark": "offline_ppo", "command": " ".join(["python", "benchmarks/offline_ppo.py", *sys.argv[1:]]),
              "machine": machine(), "rounds": args.rounds, "passes": args.passes, "overrides": args.overrides,
              "method": __doc__.split("\n\n")[1].strip(), "seeds": seeds, "summary": summarize(seeds),
              "total_seconds": time.perf_counter() - t0}
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
