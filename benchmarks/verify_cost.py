"""What checking a checkpoint against its digests costs a run's start.

    python benchmarks/verify_cost.py [--hidden 512] [--layers 8] [--out verify_cost.json]
    python benchmarks/verify_cost.py --device cuda --hidden 2048 --layers 24 --dir /dev/shm   # 1.2B, on a GPU

Trains one round of a Llama of the given shape with the in-process driver (so the checkpoint is
the real one: actor and critic safetensors, DeepSpeed's optimizer state, the manifest), then:

- `digest_s`: the check alone (`why_incomplete`: every file read and hashed), in this thread;
- a resume through `rlhf.train.Run` (`trainer.resume=auto`), whose check starts before the data
  and the policy are prepared and runs beside them and the trainer build: `build_trainer_s`,
  `verify_wait_s` (what the check adds to the start: the wait once the trainer is built),
  `restore_s` and `start_s` (the whole `Run(cfg)`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhf.config import load_config  # noqa: E402


def overrides(out: Path, hidden: int, layers: int, rounds: int, device: str = "cpu") -> list[str]:
    return [f"model.tiny.hidden_size={hidden}", f"model.tiny.num_hidden_layers={layers}",
            f"model.tiny.intermediate_size={hidden * 11 // 4}", "model.tiny.num_attention_heads=8",
            "model.tiny.num_key_value_heads=8", "model.sft.enable=false", "data.synthetic.n_train=64",
            "data.synthetic.n_val=8", "data.synthetic.n_sft=8", "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=8", "rollout.n=2", "data.max_response_length=8", f"trainer.device={device}",
            "trainer.logger=[none]", "trainer.val_before_train=false", "trainer.test_freq=-1",
            f"trainer.total_rounds={rounds}", f"trainer.output_dir={out}"]


def measure(hidden: int, layers: int, workdir: Path, device: str = "cpu") -> dict:
    from rlhf.checkpoint import rounds as ckpt
    from rlhf.train import Run, train

    out = workdir / "run"
    train(load_config(None, overrides(out, hidden, layers, 1, device)))
    last = ckpt.latest_checkpoint(out, checksums=False)
    size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    os.sync()
    t = time.perf_counter()
    assert ckpt.why_incomplete(last) == ""
    digest = time.perf_counter() - t
    t = time.perf_counter()
    run = Run(load_config(None, overrides(out, hidden, layers, 2, device)))
    start = time.perf_counter() - t
    try:
        assert run.resumed_from == str(last)
        timing = dict(run.start_timing)
    finally:
        run.close()
    params = sum(p.numel() for p in run.trainer.actor.module.parameters())
    return {"device": device, "hidden": hidden, "layers": layers, "actor_params": params, "checkpoint_bytes": size,
            "digest_s": digest, "digest_gb_per_s": size / digest / 1e9, "start_s": start,
            "build_trainer_s": timing["timing_s/build_trainer"], "verify_wait_s": timing["timing_s/verify_checkpoint"],
            "restore_s": timing["timing_s/restore"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--device", default="cpu", help="trainer.device (cpu or cuda)")
    p.add_argument("--dir", default=None, help="where the checkpoint is written (default: the system's temp dir)")
    p.add_argument("--out", help="write the results here as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="verify_cost_", dir=args.dir) as d:
        res = measure(args.hidden, args.layers, Path(d), args.device)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
