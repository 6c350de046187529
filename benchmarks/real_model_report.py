"""The results of benchmarks/real_model.py: versions, machine, the markdown table, the plot.

    python benchmarks/real_model_report.py DIR    # results.md and curve.png again from DIR/results.json
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "trl", "gguf", "datasets"):
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


def markdown(results: dict) -> str:
    """The table of both curves (strict accuracy at each evaluation) for the README."""
    warm = results["warm_start"]
    lines = [f"Instruct model: strict {warm['instruct']['strict']:.3f}; after SFT "
             f"({warm['sft_metrics'].get('sft/steps', 0)} steps, {warm['seconds']:.0f} s): strict "
             f"{warm['sft']['strict']:.3f}.", "",
             "| lane | eval | train s | step | strict | flexible | mean length |", "|---|---|---|---|---|---|---|"]
    for lane, res in results["lanes"].items():
        for i, p in enumerate(res.get("curve", [])):
            lines.append(f"| {lane} | {i} | {p['train_s']:.0f} | {p['step']} | {p['strict']:.3f} | "
                         f"{p['flexible']:.3f} | {p['response_length']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for lane, res in results["lanes"].items():
        pts = res.get("curve", [])
        ax.plot([p["train_s"] for p in pts], [p["strict"] for p in pts], marker="o", label=lane)
    ax.axhline(results["warm_start"]["instruct"]["strict"], color="grey", linestyle=":", label="instruct model")
    ax.set(xlabel="training time (s, evaluation excluded)", ylabel="strict accuracy (200 held-out, greedy)",
           title="SmolLM2-135M-Instruct, GSM8K-style problems")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def write_results(results: dict, out: Path) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2, default=str))
    os.replace(tmp, out / "results.json")
    (out / "results.md").write_text(markdown(results))
    results["plot"] = plot(results, out / "curve.png")


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    write_results(json.loads((out / "results.json").read_text()), out)
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
