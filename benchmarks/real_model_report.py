"""The results of benchmarks/real_model.py: versions, machine, tables and plots, for one run
and across seeds.

    python benchmarks/real_model_report.py DIR                       # results.md, curve.png again
    python benchmarks/real_model_report.py --seeds D0 D1 D2 --out DIR  # summary.json/.md/.png

Across seeds: for each lane, the mean and standard error (sample standard deviation over
sqrt(seeds)) of strict accuracy at the start, at fixed training times (the first evaluation
at or after each multiple of the evaluation interval) and at the end; of the held-out
evaluation; PPO's lead over each other lane, and each lane's gain over its start, paired by seed
(same start, same prompts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "trl", "gguf", "datasets", "reasoning-gym"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict:
    import torch

    info = {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    """The curves of every lane (strict accuracy at each evaluation) and the held-out table."""
    warm = results["warm_start"]
    lines = [f"Instruct model: strict {warm['instruct']['strict']:.3f}; after SFT "
             f"({warm['sft_metrics'].get('sft/steps', 0)} steps, {warm['seconds']:.0f} s): strict "
             f"{warm['sft']['strict']:.3f}.", "",
             "| lane | eval | train s | round | step | strict | flexible | mean length |",
             "|---|---|---|---|---|---|---|---|"]
    for lane, res in results["lanes"].items():
        for i, p in enumerate(res.get("curve", [])):
            lines.append(f"| {lane} | {i} | {p['train_s']:.0f} | {p.get('round', '')} | {p['step']} | "
                         f"{p['strict']:.3f} | {p['flexible']:.3f} | {p['response_length']:.0f} |")
    lines += [f"\nLane {lane} failed (exit code {res['rc']}): {res.get('failure') or res.get('error', '')}"
              for lane, res in results["lanes"].items() if failed(res)]
    memory = {lane: res["gpu_memory"] for lane, res in results["lanes"].items() if res.get("gpu_memory")}
    if memory:
        lines += ["", f"Peak GPU memory of each lane (GiB, reserved by torch; the lanes ran at once on one "
                  f"{next(iter(memory.values())).get('device', 'GPU')} of "
                  f"{next(iter(memory.values())).get('device_total_gib', 0):.0f} GiB): "
                  + ", ".join(f"{lane} {m['peak_reserved_gib']:.1f}" for lane, m in memory.items()) + "."]
    return "\n".join(lines) + "\n" + (("\n" + heldout_markdown(results)) if "heldout" in results else "")


def failed(lane_result: dict) -> bool:
    """A lane whose process did not end cleanly: its curve stops early, so it is left out of
    the means (and named) rather than counted with a short curve."""
    return lane_result.get("rc", 0) != 0 or "error" in lane_result


def heldout_markdown(results: dict) -> str:
    h = results["heldout"]
    own, other = h["sets"]["own"], h["sets"]["other"]
    lines = [f"| policy | own test ({own['task']}, strict +- SE) | other generator ({other['task']}) |",
             "|---|---|---|"]
    for name, res in h["policies"].items():
        lines.append(f"| {name} | {res['own']['strict']:.3f} +- {res['own']['strict_se']:.3f} | "
                     f"{res['other']['strict']:.3f} +- {res['other']['strict_se']:.3f} |")
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(results: dict, path: Path) -> bool:
    """Strict accuracy against training seconds and against rounds, one line per lane."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for lane, res in results["lanes"].items():
        pts = res.get("curve", [])
        axes[0].plot([p["train_s"] for p in pts], [p["strict"] for p in pts], marker="o", label=lane)
        if pts and "round" in pts[0]:
            axes[1].plot([p["round"] for p in pts], [p["strict"] for p in pts], marker="o", label=lane)
    for ax, x in zip(axes, ("training time (s, evaluation excluded)", "rounds (generations)")):
        ax.axhline(results["warm_start"]["instruct"]["strict"], color="grey", linestyle=":", label="instruct model")
        ax.set(xlabel=x, ylabel="strict accuracy (held-out, greedy)")
        ax.legend()
    fig.suptitle(f"SmolLM2-135M-Instruct, {results.get('task', 'word_problems')}, seed {results.get('seed', 0)}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(results: dict, out: Path) -> None:
    """results.json (atomically), results.md and curve.png in `out`."""
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, default=str))
    os.replace(tmp, out / "results.json")
    (out / "results.md").write_text(markdown(results))
    results["plot"] = plot(results, out / "curve.png")


# ---------------------------------------------------------------------------------
# Across seeds
# ---------------------------------------------------------------------------------


def mean_se(values: list[float]) -> dict:
    """Mean, standard error (None below two values) and count."""
    n = len(values)
    if not n:
        return {"mean": None, "se": None, "n": 0}
    se = statistics.stdev(values) / math.sqrt(n) if n > 1 else None
    return {"mean": statistics.fmean(values), "se": se, "n": n}


def first_at_or_after(curve: list[dict], t: float) -> dict | None:
    return next((p for p in curve if p["train_s"] >= t - 1e-6), None)


def _heldout(run: dict, name: str, which: str) -> float | None:
    res = run.get("heldout", {}).get("policies", {}).get(name)
    return res[which]["strict"] if res else None


def _lane_summary(runs: list[dict], lane: str, times: list[float]) -> dict:
    ok = [r for r in runs if lane in r["lanes"] and not failed(r["lanes"][lane])]
    curves = {r.get("seed", 0): r["lanes"][lane]["curve"] for r in ok if r["lanes"][lane].get("curve")}
    budget = runs[0]["sizes"]["budget"]
    at = {}
    for t in times:
        pts = [p for p in (first_at_or_after(c, t) for c in curves.values()) if p]
        at[f"{t:g}"] = mean_se([p["strict"] for p in pts]) | {"train_s": mean_se([p["train_s"] for p in pts])["mean"]}
    ends = [c[-1] for c in curves.values()]
    return {"seeds": sorted(curves), "complete": [s for s, c in curves.items() if c[-1]["train_s"] >= 0.99 * budget],
            "start": mean_se([c[0]["strict"] for c in curves.values()]), "at_train_s": at,
            "end": mean_se([p["strict"] for p in ends]), "end_train_s": mean_se([p["train_s"] for p in ends]),
            "end_rounds": mean_se([p.get("round", 0) for p in ends]),
            "heldout": {w: mean_se([v for v in (_heldout(r, lane, w) for r in ok) if v is not None])
                        for w in ("own", "other")},
            "failed": {r.get("seed", 0): r["lanes"][lane].get("failure") or r["lanes"][lane].get("error", "")
                       for r in runs if lane in r["lanes"] and failed(r["lanes"][lane])}}


def _paired(runs: list[dict], lane: str, ref: str = "ppo") -> dict:
    """`ref` minus `lane` per seed (at the end, and on each held-out set): mean, SE, mean/SE."""
    def diffs(get):
        out = []
        for r in runs:
            a, b = get(r, ref), get(r, lane)
            if a is not None and b is not None:
                out.append(a - b)
        return out

    def end(r, name):
        res = r["lanes"].get(name, {})
        return res["curve"][-1]["strict"] if res.get("curve") and not failed(res) else None

    def held(r, name, w):
        return None if name in r["lanes"] and failed(r["lanes"][name]) else _heldout(r, name, w)

    out = {"end": mean_se(diffs(end))}
    for w in ("own", "other"):
        out[f"heldout_{w}"] = mean_se(diffs(lambda r, name, w=w: held(r, name, w)))
    for v in out.values():
        v["in_se"] = v["mean"] / v["se"] if v["se"] else None
    return out


def _gain(runs: list[dict], lane: str) -> dict:
    """`lane` minus its start per seed: on each held-out set the common evaluator's score of the
    final policy minus the start's (`_paired` against "start"); in-run its last evaluation minus
    its first (one evaluator)."""
    out = _paired(runs, "start", ref=lane)
    ends = [res["curve"][-1]["strict"] - res["curve"][0]["strict"]
            for res in (r["lanes"].get(lane, {}) for r in runs) if res.get("curve") and not failed(res)]
    out["end"] = mean_se(ends)
    out["end"]["in_se"] = out["end"]["mean"] / out["end"]["se"] if out["end"]["se"] else None
    return out


def aggregate(runs: list[dict]) -> dict:
    """Mean and SE across runs (one per seed) of every lane; PPO's paired lead over the others;
    each lane's paired gain over its start."""
    s = runs[0]["sizes"]
    times = [k * s["eval_every"] for k in range(int(s["budget"] // s["eval_every"]) + 1)]
    lanes = list(dict.fromkeys(lane for r in runs for lane in r["lanes"]))
    return {"task": runs[0].get("task"), "seeds": [r.get("seed", 0) for r in runs], "sizes": s, "times": times,
            "lanes": {lane: _lane_summary(runs, lane, times) for lane in lanes},
            "start_heldout": {w: mean_se([v for v in (_heldout(r, "start", w) for r in runs) if v is not None])
                              for w in ("own", "other")},
            "ppo_lead": {lane: _paired(runs, lane) for lane in lanes if lane != "ppo" and "ppo" in lanes},
            "gain": {lane: _gain(runs, lane) for lane in lanes},
            "commands": [r["command"] for r in runs], "versions": runs[0].get("versions"),
            "machine": runs[0].get("machine")}


def _fmt(m: dict) -> str:
    if m["mean"] is None:
        return "-"
    return f"{m['mean']:.3f} +- {m['se']:.3f}" if m["se"] is not None else f"{m['mean']:.3f} (one seed)"


def seeds_markdown(agg: dict) -> str:
    times = [f"{t:g}" for t in agg["times"][1:]]
    lines = [f"Task {agg['task']}, seeds {', '.join(map(str, agg['seeds']))}: strict accuracy, mean +- SE over "
             f"seeds, on {agg['sizes']['n_val']} test problems.", "",
             "| lane | " + " | ".join(f"{t} s" for t in times) + " | end | train s | rounds | own test | "
             "other generator |", "|---" * (len(times) + 6) + "|"]
    for lane, L in agg["lanes"].items():
        name = lane if len(L["seeds"]) == len(agg["seeds"]) else f"{lane} ({len(L['seeds'])} of {len(agg['seeds'])} seeds)"
        lines.append(f"| {name} | " + " | ".join(_fmt(L["at_train_s"][t]) for t in times) +
                     f" | {_fmt(L['end'])} | {L['end_train_s']['mean'] or 0:.0f} | {L['end_rounds']['mean'] or 0:.1f}"
                     f" | {_fmt(L['heldout']['own'])} | {_fmt(L['heldout']['other'])} |")
    sh = agg["start_heldout"]
    lines.append("| start (SFT) | " + " | ".join("" for _ in times) +
                 f" | {_fmt(agg['lanes'].get('ppo', next(iter(agg['lanes'].values())))['start'])} | 0 | 0 | "
                 f"{_fmt(sh['own'])} | {_fmt(sh['other'])} |")

    def paired_table(title: str, rows: dict) -> list[str]:
        out = ["", f"| {title} | end of run | in SEs | own test | in SEs | other generator | in SEs |",
               "|---|---|---|---|---|---|---|"]
        for lane, d in rows.items():
            cells = [f"{_fmt(d[k])} | " + (f"{d[k]['in_se']:.1f}" if d[k]["in_se"] is not None else "-")
                     for k in ("end", "heldout_own", "heldout_other")]
            out.append(f"| {lane} | " + " | ".join(cells) + " |")
        return out

    if agg["ppo_lead"]:
        lines += paired_table("PPO minus (paired by seed)", agg["ppo_lead"])
    if agg.get("gain"):
        lines += paired_table("lane minus its start (paired by seed)", agg["gain"])
    failures = [f"- {lane}, seed {seed}: {why or 'no reason in its log'}"
                for lane, L in agg["lanes"].items() for seed, why in L["failed"].items()]
    if failures:
        lines += ["", "Lanes that failed, left out of the means and differences above (each cell's mean is over "
                  "the seeds whose lane finished):", *failures]
    return "\n".join(lines) + "\n"


def seeds_plot(runs: list[dict], agg: dict, path: Path) -> bool:
    """Mean +- SE against training seconds (seeds thin), and every seed against rounds."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (lane, L) in enumerate(agg["lanes"].items()):
        color = f"C{i}"
        pts = [(L["at_train_s"][f"{t:g}"], t) for t in agg["times"] if L["at_train_s"][f"{t:g}"]["mean"] is not None]
        xs, ms = [t for _, t in pts], [m["mean"] for m, _ in pts]
        ses = [m["se"] or 0.0 for m, _ in pts]
        axes[0].plot(xs, ms, color=color, marker="o", label=f"{lane} (mean of {len(L['seeds'])})")
        axes[0].fill_between(xs, [m - s for m, s in zip(ms, ses)], [m + s for m, s in zip(ms, ses)], color=color,
                             alpha=0.2)
        for r in runs:
            c = r["lanes"].get(lane, {}).get("curve", [])
            axes[0].plot([p["train_s"] for p in c], [p["strict"] for p in c], color=color, alpha=0.25, lw=0.8)
            axes[1].plot([p.get("round", 0) for p in c], [p["strict"] for p in c], color=color, alpha=0.6,
                         marker=".", label=lane if r is runs[0] else None)
    for ax, x in zip(axes, ("training time (s, evaluation excluded)", "rounds (generations)")):
        ax.set(xlabel=x, ylabel="strict accuracy (held-out, greedy)")
        ax.legend()
    fig.suptitle(f"SmolLM2-135M-Instruct, {agg['task']}, seeds {', '.join(map(str, agg['seeds']))}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_summary(run_dirs: list[str], out: Path) -> dict:
    runs = [json.loads((Path(d) / "results.json").read_text()) for d in run_dirs]
    tasks = {r.get("task", "word_problems") for r in runs}
    if len(tasks) != 1:
        sys.exit(f"error: the runs trained on different tasks ({sorted(tasks)}); summarize each task alone")
    seeds = [r.get("seed", 0) for r in runs]
    if len(set(seeds)) != len(seeds):
        sys.exit(f"error: the runs' seeds repeat ({seeds}, from {', '.join(map(str, run_dirs))}); "
                 "give one run directory per seed")
    # Every lane trains for a budget of seconds, so seeds run on different GPUs or with other
    # settings measure different things: they are never averaged together.
    for what, value in (("GPU", lambda r: (r.get("machine") or {}).get("gpu")),
                        ("settings (sizes)", lambda r: r.get("sizes"))):
        groups: dict[str, list[str]] = {}
        for d, r in zip(run_dirs, runs):
            groups.setdefault(json.dumps(value(r), sort_keys=True), []).append(str(d))
        if len(groups) > 1:
            sys.exit(f"error: the runs differ in their {what}: " + "; ".join(
                f"{k} in {', '.join(v)}" for k, v in groups.items()) + ". The lanes train for a budget of seconds, "
                "so run every seed of a summary on the same GPU with the same settings")
    agg = aggregate(runs) | {"runs": [str(d) for d in run_dirs]}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(agg, indent=2, default=str))
    os.replace(tmp, out / "summary.json")
    (out / "summary.md").write_text(seeds_markdown(agg))
    agg["plot"] = seeds_plot(runs, agg, out / "summary.png")
    return agg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", nargs="?", help="one run: results.md and curve.png again from its results.json")
    p.add_argument("--seeds", nargs="+", default=[], help="run directories, one per seed")
    p.add_argument("--out", default="", help="with --seeds: where summary.json, .md and .png go")
    a = p.parse_args(argv)
    if a.seeds:
        write_summary(a.seeds, Path(a.out or Path(a.seeds[0]).parent))
        print((Path(a.out or Path(a.seeds[0]).parent) / "summary.md").read_text())
        return 0
    if not a.run_dir:
        p.error("give a run directory, or --seeds DIR ...")
    out = Path(a.run_dir)
    write_results(json.loads((out / "results.json").read_text()), out)
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
