"""Where the time of a profiled step goes, read from its Chrome trace (`trainer.profile_steps`).

For every named range of the trainer (the stages, and forward/backward/grad_norm/
optimizer_step inside the updates): calls, wall time on the host, and how much of that
wall time the GPU spent running kernels (busy fraction: below ~0.9 the GPU waits on the
host, a synchronisation or a launch-bound loop; near 1 the kernels themselves are slow).
Plus the kernels that take the most time inside the update stages, grouped by kind.

    python benchmarks/trace_summary.py outputs/profile/step_2/trace.json.gz [--json out.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from bisect import bisect_left
from collections import defaultdict
from pathlib import Path

RANGES = ("old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
SUB = ("forward", "backward", "grad_norm", "optimizer_step")
KINDS = (  # first match wins: (kind, pattern over the kernel name)
    ("attention", r"flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|matmul|cublas|wgmma"),
    ("nccl", r"nccl"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copy/cast", r"copy|cast|convert|memcpy|memset|fill"),
    ("reduce", r"reduce|norm|sum|max|argmax|softmax|logsumexp"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton"),
)


def load(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def kind(name: str) -> str:
    low = name.lower()
    for k, pat in KINDS:
        if re.search(pat, low):
            return k
    return "other"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _busy(union: list[tuple[float, float]], starts: list[float], s: float, e: float) -> float:
    """Time inside [s, e] covered by the union of kernel intervals."""
    i = max(bisect_left(starts, s) - 1, 0)
    total = 0.0
    while i < len(union) and union[i][0] < e:
        a, b = union[i]
        total += max(0.0, min(b, e) - max(a, s))
        i += 1
    return total


def summarize(events: list[dict], top: int = 25) -> dict:
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    union = _union([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    starts = [s for s, _ in union]
    names = set(RANGES) | {f"{p}/{s}" for p in ("actor", "critic") for s in SUB}
    ranges: dict[str, dict] = defaultdict(lambda: {"calls": 0, "wall_ms": 0.0, "gpu_busy_ms": 0.0})
    windows = []
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") in names and "dur" in e:
            r = ranges[e["name"]]
            r["calls"] += 1
            r["wall_ms"] += e["dur"] / 1e3
            r["gpu_busy_ms"] += _busy(union, starts, e["ts"], e["ts"] + e["dur"]) / 1e3
            if e["name"] in ("update_actor", "update_critic"):
                windows.append((e["ts"], e["ts"] + e["dur"]))
    for r in ranges.values():
        r["gpu_busy_frac"] = r["gpu_busy_ms"] / r["wall_ms"] if r["wall_ms"] else 0.0
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    per_kind: dict[str, float] = defaultdict(float)
    for k in kernels:
        if any(s <= k["ts"] < e for s, e in windows):
            per_kernel[k["name"]][0] += 1
            per_kernel[k["name"]][1] += k["dur"] / 1e3
            per_kind[kind(k["name"])] += k["dur"] / 1e3
    top_k = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    return {"ranges": dict(ranges),
            "update_kernel_ms_by_kind": dict(sorted(per_kind.items(), key=lambda kv: -kv[1])),
            "update_top_kernels": [{"name": n[:160], "kind": kind(n), "calls": c, "total_ms": t}
                                   for n, (c, t) in top_k],
            "n_kernels": len(kernels)}


def format_summary(s: dict) -> str:
    lines = [f"{'range':<24} {'calls':>6} {'wall_ms':>10} {'gpu_busy_ms':>12} {'busy':>6}"]
    for name, r in sorted(s["ranges"].items(), key=lambda kv: -kv[1]["wall_ms"]):
        lines.append(f"{name:<24} {r['calls']:>6} {r['wall_ms']:>10.1f} {r['gpu_busy_ms']:>12.1f} "
                     f"{r['gpu_busy_frac']:>6.2f}")
    lines.append("\nkernel time inside update_actor + update_critic, by kind (ms):")
    lines += [f"  {k:<14} {v:>10.1f}" for k, v in s["update_kernel_ms_by_kind"].items()]
    lines.append("\ntop kernels there:")
    lines += [f"  {k['total_ms']:>9.1f} ms {k['calls']:>6}x {k['kind']:<12} {k['name'][:110]}"
              for k in s["update_top_kernels"]]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--json", help="also write the summary here")
    a = p.parse_args(argv)
    s = summarize(load(a.trace))
    print(format_summary(s))
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
