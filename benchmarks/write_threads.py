"""How fast the checkpoint writer puts tensors into files, by I/O thread count.

Writes `--files` safetensors files of `--gib` GiB each (bf16 tensors on the GPU, or the
host without one) with `rlhf.checkpoint.tensor_files.write_safetensors`, all files at once as a
checkpoint save does, for each thread count, into a fresh folder under `--dir`; prints and
writes GB/s. The first pass also pays for memory the machine has not yet handed out, so
the order is repeated.

    python benchmarks/write_threads.py --dir /dev/shm/wt --threads 4 8 16 --out write_threads.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf.checkpoint import pieces, tensor_files as tf  # noqa: E402


def write_all(root: Path, tensors: list[dict]) -> float:
    root.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    threads = [threading.Thread(target=tf.write_safetensors, args=(root / f"f{i}.safetensors", ts))
               for i, ts in enumerate(tensors)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--threads", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--out", default="")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = int(a.gib * 2**30 / 2 / 64)  # rows of 64 bf16 values
    tensors = [{f"t{j}": torch.randn(n // 8, 64, device=device).to(torch.bfloat16) for j in range(8)}
               for _ in range(a.files)]
    total = sum(t.numel() * 2 for ts in tensors for t in ts.values())
    rows = []
    for rep in range(2):
        for k in a.threads:
            pieces.IO_THREADS, pieces._POOL = k, None
            root = Path(a.dir) / f"r{rep}_t{k}"
            s = write_all(root, tensors)
            rows.append({"pass": rep, "threads": k, "seconds": s, "gb_per_s": total / s / 1e9})
            print(f"pass {rep} threads {k}: {total / 1e9:.1f} GB in {s:.2f} s = {total / s / 1e9:.2f} GB/s", flush=True)
            shutil.rmtree(root)
    result = {"benchmark": "write_threads", "command": " ".join(["python"] + sys.argv), "device": str(device),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "", "bytes": total, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
