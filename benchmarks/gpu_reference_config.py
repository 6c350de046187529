"""The 8-GPU reference configuration, and the same per-GPU work on fewer GPUs.

    python benchmarks/gpu_reference_config.py --gpus 2 --out benchmarks/results/reference_config_sizes.json

Checks that the configuration users start from on one 8-GPU node is accepted and splits as
intended (`rlhf.config.derive_sizes`), and derives the overrides that keep every per-GPU
size when the same script runs on `--gpus` GPUs (the global batch shrinks by 8 / gpus).
Prints the `update_throughput.py` arguments of that run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

REFERENCE = {  # one 8-GPU node
    "trainer.n_gpus_per_node": 8, "trainer.nnodes": 1, "deepspeed.zero_stage": 2, "deepspeed.bf16": True,
    "model.dtype": "bfloat16", "actor.ppo_micro_batch_size_per_gpu": 4, "critic.ppo_micro_batch_size_per_gpu": 4,
    "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 16384, "data.train_batch_size": 1024,
    "actor.ppo_mini_batch_size": 256, "data.max_prompt_length": 512, "data.max_response_length": 256,
    "rollout.n": 4, "algorithm.kl_ctrl.kl_coef": 0.001, "actor.clip_ratio": 0.2,
    "data.use_sequence_packing": True,
}


def overrides(d: dict) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items()]


def scaled(gpus: int) -> dict:
    """The reference with the global batch scaled to `gpus` GPUs, per-GPU sizes unchanged."""
    f = 8 // gpus
    return {**REFERENCE, "trainer.n_gpus_per_node": gpus, "data.train_batch_size": 1024 // f,
            "actor.ppo_mini_batch_size": 256 // f}


def per_gpu(s) -> dict:
    return {"responses_per_gpu": s.responses_per_gpu, "mini_batch_per_gpu": s.mini_batch_per_gpu,
            "micro_batch_per_gpu": s.micro_batch_per_gpu, "num_mini_batches": s.num_mini_batches}


def main(argv=None) -> None:
    from rlhf.config import derive_sizes, load_config

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gpus", type=int, default=2, choices=(1, 2, 4, 8))
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    ref_cfg = load_config(None, overrides(REFERENCE))
    ref_sizes = derive_sizes(ref_cfg)  # world size from n_gpus_per_node * nnodes
    small = scaled(a.gpus)
    small_sizes = derive_sizes(load_config(None, overrides(small)))
    assert ref_sizes.world_size == 8, ref_sizes
    assert per_gpu(ref_sizes) == per_gpu(small_sizes), (per_gpu(ref_sizes), per_gpu(small_sizes))
    args = ["--variant", "packed", "--prompts", str(small["data.train_batch_size"]), "--rollout-n", "4",
            "--max-prompt", "512", "--max-response", "256", "--mini", str(small["actor.ppo_mini_batch_size"]),
            "--micro", "4", "--max-tokens", "16384", "--zero", "2"]
    out = {"reference_overrides": overrides(REFERENCE), "reference_sizes": ref_sizes.__dict__,
           f"scaled_to_{a.gpus}_gpus_overrides": overrides(small), f"scaled_to_{a.gpus}_gpus_sizes": small_sizes.__dict__,
           "per_gpu_equal": True, "update_throughput_args": args}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2))
    print(" ".join(args))


if __name__ == "__main__":
    main()
