"""Does RL earn its place? PPO's gain against more SFT for the same wall time.

For each seed: build the SFT-warm-started tiny policy (the default run's start), then
  (a) PPO with the rule reward on fresh unlabeled prompts for the configured rounds;
  (b) continued SFT on the same small labeled set, from the same start, for PPO's wall time;
and report greedy validation accuracy of the start, (a) and (b), side by side.

    python benchmarks/ppo_vs_sft.py [--seeds 0 1 2] [key=value ...]

Writes benchmarks/results/ppo_vs_sft.json with the machine, command and figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace as dc_replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def continue_sft(cfg, base_dir: str, seconds: float, seed: int) -> dict[str, float]:
    """Greedy val metrics after `seconds` more SFT on the labeled split, from `base_dir`."""
    from rlhf import stages
    from rlhf.evaluate import evaluate_greedy
    from rlhf.models.default import sft_targets
    from rlhf.models.load import load_causal_lm, load_tokenizer
    from rlhf.models.sft import sft_warm_start
    from rlhf.rollout.hf import HFRolloutEngine

    data = stages.prepare_data(cfg)
    model, tok = load_causal_lm(base_dir), load_tokenizer(base_dir)
    sft_cfg = dc_replace(cfg.model.sft, max_seconds=seconds, max_steps=0, epochs=10**6, warmup_steps=0,
                         lr_schedule="constant", lr=cfg.model.sft.lr * cfg.model.sft.min_lr_ratio)
    m = sft_warm_start(model, tok, data.sft["prompt"].tolist(), sft_targets(data.sft), sft_cfg, seed=seed + 1,
                       progress=False)
    engine = HFRolloutEngine(model, tok, batch_size=cfg.rollout.generate_batch_size)
    val = evaluate_greedy(engine, tok, data.val, cfg.data.max_prompt_length, cfg.data.max_response_length,
                          cfg.reward)
    return {"val/accuracy": val["val/accuracy"], "sft/steps": m["sft/steps"], "sft/seconds": m["sft/seconds"]}


def one_seed(seed: int, overrides: list[str], out_root: Path) -> dict:
    from rlhf.config import load_config
    from rlhf.train import train

    out = out_root / f"seed{seed}"
    cfg = load_config(None, [f"trainer.seed={seed}", f"trainer.output_dir={out}", "trainer.resume=disable",
                             "trainer.logger=[console]"] + overrides)
    t0 = time.perf_counter()
    ppo = train(cfg)
    total = time.perf_counter() - t0
    sft_meta = json.loads((out / "base_model" / "sft_metrics.json").read_text())
    ppo_seconds = total - sft_meta.get("sft/seconds", 0.0)
    sft = continue_sft(cfg, str(out / "base_model"), ppo_seconds, seed)
    return {
        "seed": seed,
        "start_accuracy": ppo["val_score_start"],
        "ppo_accuracy_end": ppo["val_score_end"],
        "ppo_accuracy_best": ppo["val_score_best"],
        "ppo_gain": ppo["val_score_end"] - ppo["val_score_start"],
        "ppo_seconds": ppo_seconds,
        "total_seconds_incl_sft": total,
        "sft_warm_start_seconds": sft_meta.get("sft/seconds"),
        "more_sft_accuracy": sft["val/accuracy"],
        "more_sft_gain": sft["val/accuracy"] - ppo["val_score_start"],
        "more_sft_steps": sft["sft/steps"],
        "val_curve": [(h["step"], h["score"]) for h in ppo["val_history"]],
        "stop_reason": ppo["stop_reason"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_ppo_vs_sft"))
    p.add_argument("--result", default=str(ROOT / "benchmarks" / "results" / "ppo_vs_sft.json"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    rows = [one_seed(s, args.overrides, Path(args.out)) for s in args.seeds]
    result = {
        "benchmark": "ppo_vs_sft",
        "command": " ".join(["python"] + sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "overrides": args.overrides,
        "seeds": rows,
        "mean_ppo_gain": sum(r["ppo_gain"] for r in rows) / len(rows),
        "mean_more_sft_gain": sum(r["more_sft_gain"] for r in rows) / len(rows),
        "ppo_beats_sft_all_seeds": all(r["ppo_accuracy_end"] > r["more_sft_accuracy"] for r in rows),
    }
    Path(args.result).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "seeds"}, indent=2))
    for r in rows:
        print(f"seed {r['seed']}: start {r['start_accuracy']:.3f} ppo {r['ppo_accuracy_end']:.3f} "
              f"(+{r['ppo_gain']:.3f} in {r['ppo_seconds']:.0f}s) more-sft {r['more_sft_accuracy']:.3f}")


if __name__ == "__main__":
    main()
