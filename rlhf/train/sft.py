"""SFT warm-start of the tiny default policy on synthetic arithmetic, then greedy validation.

    python -m rlhf.train.sft [--cfg F] [--out DIR] [--threads N] [key=value ...]

Prints SFT progress, then `val/accuracy` on the `data.synthetic` validation split.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rlhf.config.load import load_config
from rlhf.config.schema import ConfigError
from rlhf.data.arithmetic import make_splits
from rlhf.models.load import save_model_atomic
from rlhf.rollout.hf import HFRolloutEngine
from rlhf.round.evaluate import evaluate_greedy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlhf.train.sft", description=__doc__.split("\n")[0])
    p.add_argument("--cfg", default=None, help="YAML/JSON config file (defaults if omitted)")
    p.add_argument("--out", default="", help="save the warm-started policy here (safetensors + tokenizer)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 => torch's default); 1 is steadier on a small shared CPU")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. model.sft.max_steps=200")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    try:
        cfg = load_config(args.cfg, args.overrides)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    from rlhf.trainer.default_policy import warm_start  # loads transformers: only when the command runs

    splits = make_splits(cfg.data.synthetic)
    print(f"data: {len(splits['sft'])} SFT problems, {len(splits['val'])} validation problems", flush=True)
    model, tok, metrics = warm_start(cfg, splits["sft"])
    if args.out:
        save_model_atomic(model, tok, args.out)
        print(f"saved policy to {args.out}", flush=True)
    print(f"greedy validation on {len(splits['val'])} problems ...", flush=True)
    start = time.perf_counter()
    engine = HFRolloutEngine(model, tok, batch_size=cfg.rollout.generate_batch_size)
    metrics.update(evaluate_greedy(engine, tok, splits["val"], cfg.data.max_prompt_length,
                                   cfg.data.max_response_length, cfg.reward))
    metrics["timing_s/validate"] = time.perf_counter() - start
    print(json.dumps({k: round(v, 4) for k, v in metrics.items()}), flush=True)
    print(f"val/accuracy {metrics['val/accuracy']:.3f}", flush=True)
    return metrics


if __name__ == "__main__":
    main()
