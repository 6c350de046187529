"""Held-out evaluation of the policies a benchmarks/real_model.py run saved.

    python benchmarks/real_model_heldout.py RUN_DIR [--device cuda] [--policy NAME=DIR ...]

Each policy (the SFT start `RUN_DIR/sft_model`, every lane's final policy under
`RUN_DIR/policies/`, and any `--policy NAME=DIR`) is evaluated the same way: loaded in
float32, greedy decoding, strict accuracy with the project's GSM8K scorer and its standard
error, on (a) the test split of the generator it trained on and (b) the test split of the
other generator (gsm_symbolic for a word-problem run, word problems for a gsm_symbolic run),
each with that generator's response budget. The table goes into `RUN_DIR/results.json`
under `heldout` (and `results.md`, `curve.png` are written again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.real_model_common import TASKS, load_split, strict_accuracy  # noqa: E402


def policies(run_dir: Path, extra: list[str]) -> dict[str, str]:
    """{name: model directory}: the start, the lanes' saved policies, then `extra` (NAME=DIR)."""
    found = {"start": run_dir / "sft_model"} if (run_dir / "sft_model").is_dir() else {}
    found |= {p.name: p for p in sorted((run_dir / "policies").glob("*")) if p.is_dir() and p.name[0] != "."}
    for item in extra:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_dir():
            sys.exit(f"error: --policy {item!r}: give NAME=DIR with DIR a saved model directory")
        found[name] = Path(path)
    if not found:
        sys.exit(f"error: {run_dir} holds no sft_model or policies/*; run benchmarks/real_model.py there first")
    return {k: str(v) for k, v in found.items()}


def evaluate_policy(path: str, sets: dict[str, dict], device) -> dict:
    """`path`'s strict accuracy on each evaluation set ({name: {dir, max_response}})."""
    import torch

    from rlhf.models.load import load_causal_lm, load_tokenizer

    model = load_causal_lm(path, dtype="float32", device=device).eval()
    tok = load_tokenizer(path)
    out = {}
    for name, spec in sets.items():
        t = time.perf_counter()
        with torch.no_grad():
            res = strict_accuracy(model, tok, load_split(spec["dir"], "test"), spec["max_response"])
        out[name] = res | {"eval_s": round(time.perf_counter() - t, 2)}
    del model
    return out


def evaluate_run(run_dir: Path, results: dict, extra: list[str] = (), device: str = "") -> dict:
    """The held-out table of one run (its `results` give the evaluation sets)."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    data = results["data"]
    sets = {which: {"task": data[which]["task"], "dir": data[which]["dir"],
                    "max_response": data[which].get("max_response", TASKS[data[which]["task"]]["max_response"])}
            for which in ("own", "other")}
    table = {}
    for name, path in policies(run_dir, list(extra)).items():
        table[name] = evaluate_policy(path, sets, dev) | {"path": path}
        print(f"heldout {name}: " + ", ".join(f"{w} ({sets[w]['task']}) {table[name][w]['strict']:.3f} "
                                               f"+- {table[name][w]['strict_se']:.3f}" for w in sets), flush=True)
    return {"sets": sets, "device": str(dev), "dtype": "float32", "decoding": "greedy", "policies": table}


def main(argv=None) -> int:
    from benchmarks import real_model_report as R

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--device", default="", help="cuda or cpu (default: cuda when present)")
    p.add_argument("--policy", action="append", default=[], help="NAME=DIR: another saved policy to evaluate")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    if "data" not in results:
        sys.exit(f"error: {run_dir}/results.json names no evaluation sets (a run of an older real_model.py); "
                 "run benchmarks/real_model.py again")
    results["heldout"] = evaluate_run(run_dir, results, a.policy, a.device)
    R.write_results(results, run_dir)
    print(R.heldout_markdown(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
