"""Does the sweep find something, and is it sure? The sweep (round budget, successive
halving, confirm phase) run the way a user runs it, `pyflyte run sweeps/sweep.py ppo_sweep`,
from the embedded default or from a deliberately poor start, and its confirm table kept.

    python benchmarks/sweep_confirm.py --tag default
    python benchmarks/sweep_confirm.py --tag poor_start \\
        algorithm.kl_ctrl.kl_coef=0.5 actor.clip_ratio=0.02 actor.entropy_coeff=0.05

The base config is the sweep's embedded default (`sweeps.sweep.SWEEP_CFG`) with the given
overrides, written as a YAML file and passed with `--cfg`; the sweep settings are the
embedded default (`DEFAULT_SWEEP`) unless `--sweep FILE` is given. Each run gets a fresh
output directory (so a fresh study). Writes benchmarks/results/sweep_confirm_<tag>.json:
the command, the wall time, the objective, `default_scores` (the base config's objective on
each confirm seed), `best_scores` (the recommended config's: the confirmed winner, or the
default when none beat it), the confirm table and the decision.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def base_config_file(overrides: list[str], out_dir: Path) -> Path:
    """The embedded sweep config with `overrides` (and its outputs under `out_dir`) as YAML."""
    from rlhf.config import replace
    from sweeps.report import write_config_yaml
    from sweeps.sweep import SWEEP_CFG

    cfg = replace(SWEEP_CFG, [*overrides, f"trainer.output_dir={out_dir}", "trainer.logger=[none]"])
    return write_config_yaml(cfg, out_dir / "base_config.yaml", "base config of benchmarks/sweep_confirm.py")


def result(summary: dict, command: str, wall_s: float, overrides: list[str]) -> dict:
    """The results JSON from the sweep's summary.json."""
    rows = summary["confirm"]["rows"]
    default = next(r for r in rows if r["trial"] < 0)
    chosen = next((r for r in rows if r["label"] == summary["confirm"]["winner"]), default)
    return {
        "command": command, "wall_s": round(wall_s, 1), "overrides": overrides,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_end": os.getloadavg()},
        "objective": summary["objective"], "round_budget": summary["round_budget"],
        "rounds_spent": summary["rounds_spent"], "states": summary["states"],
        "chosen": summary["chosen"], "reason": summary["chosen_reason"],
        "seeds": default["seeds"], "default_scores": default["scores"], "best_scores": chosen["scores"],
        "default_mean_se": [default["mean"], default["se"]], "best_mean_se": [chosen["mean"], chosen["se"]],
        "confirm_table": [{k: r[k] for k in ("label", "trial", "params", "seeds", "scores", "final_vals",
                                             "mean", "se", "n", "failed_seeds")} for r in rows],
        "best_trial_of_search": summary["best"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", default="default", help="names the output directory and the results file")
    ap.add_argument("--sweep", default="", help="a SweepConfig file (default: the embedded DEFAULT_SWEEP)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"), help="where the JSON goes")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the embedded sweep config")
    args = ap.parse_args()
    out_dir = ROOT / "outputs" / f"bench_sweep_confirm_{args.tag}"
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh study every time
    out_dir.mkdir(parents=True)
    cfg_file = base_config_file(args.overrides, out_dir)
    cmd = [str(Path(sys.executable).with_name("pyflyte")), "run", "sweeps/sweep.py", "ppo_sweep", "--cfg",
           str(cfg_file)] + (["--sweep", args.sweep] if args.sweep else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "FLYTE_LOCAL_CACHE_ENABLED": "false"}
    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    wall = time.time() - t0
    (summary_file,) = (out_dir / "sweeps").glob("*/summary.json")  # a fresh output dir holds one study
    summary = json.loads(summary_file.read_text())
    command = f"python benchmarks/sweep_confirm.py --tag {args.tag} {shlex.join(args.overrides)}".strip()
    data = result(summary, command + (f" --sweep {args.sweep}" if args.sweep else ""), wall, args.overrides)
    path = Path(args.results) / f"sweep_confirm_{args.tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps({k: data[k] for k in ("chosen", "reason", "default_scores", "best_scores", "wall_s")}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
