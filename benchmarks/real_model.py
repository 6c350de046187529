"""SmolLM2-135M-Instruct learning GSM8K-style word problems: SFT warm-start, then PPO, beside TRL.

    python benchmarks/real_model.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR   # one H200
    python benchmarks/real_model.py --gguf FILE --out DIR --cpu-smoke --trl-site DIR   # a few steps on CPU

The recipe a user would choose from an instruct checkpoint that never writes GSM8K's
`#### N` (strict accuracy 0, so pure RL sees all-zero groups and no gradient):

1. Convert the GGUF file to safetensors (`rlhf.models.gguf`, the code `model.path` uses).
2. Write synthetic GSM8K-style word problems in verl's layout (`rlhf.data.word_problems`):
   train prompts, 200 held-out problems, a small labeled set with worked solutions.
3. SFT warm-start on the labeled set (chat template, loss on the answer only), kept short
   so that it teaches the format and leaves the arithmetic to RL: 10 steps of 8 at lr 3e-5
   (5 warmup), bf16 autocast per step on the GPU. On CPU (fp32) that start writes the
   worked solution and `#### N` on every held-out problem, strict 10/32.
4. From that start, two lanes at once on the same GPU, each with the same wall budget of
   training time (evaluation excluded), the same train prompts and the same reward (verl's
   strict GSM8K score, `reward.format_score` for a well-formed wrong answer):
   - ppo: this project's in-process driver (`rlhf.train.Run`) with examples/smollm2_gsm8k_1gpu.yaml;
   - trl: TRL's GRPOTrainer (benchmarks/real_model_trl.py).
   Both are evaluated with the same code: greedy decoding of the 200 held-out problems,
   strict accuracy, at the start and every `--eval-every` seconds of training.

Writes `<out>/results.json` (the curves of both lanes, the SFT stage, commands, versions,
machine), `<out>/results.md` (the table) and `<out>/curve.png` (when matplotlib is present).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EXAMPLE_CFG = ROOT / "examples" / "smollm2_gsm8k_1gpu.yaml"
FORMAT_SCORE = 0.1  # reward of a well-formed (`#### N`) wrong answer, in both lanes
ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}


def sizes(a) -> dict:
    """Problem counts, SFT and evaluation settings; `--cpu-smoke` shrinks everything."""
    if a.cpu_smoke:
        return dict(n_train=64, n_val=8, n_sft=8, sft_steps=2, sft_batch=4, max_response=24, budget=a.budget or 40,
                    eval_every=a.eval_every or 20)
    return dict(n_train=a.n_train, n_val=a.n_val, n_sft=a.n_sft, sft_steps=a.sft_steps, sft_batch=a.sft_batch,
                max_response=a.max_response, budget=a.budget or 270, eval_every=a.eval_every or 45)


# ---------------------------------------------------------------------------------
# Shared by both lanes: data, reward, evaluation
# ---------------------------------------------------------------------------------


def load_split(data_dir: str, split: str):
    """A split as the flat prompt table (chat list as JSON in `prompt`)."""
    from rlhf.data.io import read_prompts

    return read_prompts(os.path.join(data_dir, f"{split}.parquet"))


def reward(response: str, ground_truth: str) -> float:
    """verl's strict GSM8K score with a small score for a well-formed wrong answer."""
    from rlhf.rewards.gsm8k import compute_score

    return compute_score(response, str(ground_truth), "strict", format_score=FORMAT_SCORE)


def strict_accuracy(model, tokenizer, val, max_response: int) -> dict[str, float]:
    """Greedy decoding of every validation problem: strict and flexible GSM8K accuracy and the
    mean response length. `model` keeps its device and its train/eval mode."""
    from rlhf.data.sampling import encode_prompts
    from rlhf.rewards.gsm8k import compute_score
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.hf import HFRolloutEngine

    device = next(model.parameters()).device
    engine = HFRolloutEngine(model, tokenizer, batch_size=256, device=device)
    ids = encode_prompts(val["prompt"].tolist(), tokenizer, "chat")
    out = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_response))
    gts = [str(g) for g in val["ground_truth"]]
    strict = [compute_score(t, g, "strict") for t, g in zip(out.response_text, gts)]
    flexible = [compute_score(t, g, "flexible") for t, g in zip(out.response_text, gts)]
    return {"strict": sum(strict) / len(gts), "flexible": sum(flexible) / len(gts),
            "response_length": sum(len(r) for r in out.response_ids) / len(gts), "sample": out.response_text[0]}


class Curve:
    """Evaluations of one lane against its training time (evaluation time excluded)."""

    def __init__(self, model, tokenizer, val, max_response: int, eval_every: float, lane: str = "",
                 path: str = ""):
        self.model, self.tokenizer, self.val, self.max_response = model, tokenizer, val, max_response
        self.eval_every, self.next_eval, self.points = eval_every, 0.0, []
        self.t_train, self.t0 = 0.0, time.perf_counter()
        self.lane, self.path = lane, path  # each evaluation is saved there at once: a lane cut short keeps its curve

    def due(self) -> bool:
        return self.t_train >= self.next_eval

    def evaluate(self, step: int) -> dict:
        t = time.perf_counter()
        point = {"step": step, "train_s": round(self.t_train, 2), **strict_accuracy(
            self.model, self.tokenizer, self.val, self.max_response)}
        point["eval_s"] = round(time.perf_counter() - t, 2)
        point["wall_s"] = round(time.perf_counter() - self.t0, 2)
        self.points.append(point)
        self.next_eval = self.t_train + self.eval_every
        if self.path:
            write_json({"lane": self.lane, "curve": self.points, "train_s": self.t_train, "partial": True}, self.path)
        print(f"eval step {step} train {self.t_train:.0f}s strict {point['strict']:.3f} "
              f"flexible {point['flexible']:.3f} len {point['response_length']:.0f}", flush=True)
        return point


def write_json(obj: dict, path: str) -> None:
    """`obj` as JSON at `path`, atomically (a temp file, then a rename)."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------
# Stages of the orchestrator
# ---------------------------------------------------------------------------------


def convert(a, out: Path) -> str:
    """The GGUF file (its sha256 checked) converted to a safetensors directory under `out`."""
    from rlhf.models.gguf import convert_gguf, file_sha256

    sha = file_sha256(a.gguf)
    if a.gguf_sha256 and sha != a.gguf_sha256:
        sys.exit(f"error: {a.gguf} has sha256 {sha}, expected {a.gguf_sha256}; join the parts again "
                 "(cat part0 part1 > file) or pass --gguf-sha256 ''")
    return convert_gguf(a.gguf, str(out / "models"))


def write_data(out: Path, s: dict, seed: int) -> str:
    from rlhf.data.word_problems import write_splits

    data = out / "data"
    write_splits(str(data), {"train": s["n_train"], "test": s["n_val"], "sft": s["n_sft"]}, seed=seed)
    return str(data)


def warm_start(model_dir: str, data_dir: str, s: dict, out: Path, device) -> dict:
    """Greedy strict accuracy of the instruct model, the SFT warm-start on the labeled split,
    the accuracy after it; the warm-started policy saved as `<out>/sft_model`."""
    from rlhf.config import SFTConfig
    from rlhf.models.load import load_causal_lm, load_tokenizer, save_model_atomic
    from rlhf.trainer.sft import sft_warm_start

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype="float32", device=device)
    val, sft = load_split(data_dir, "test"), load_split(data_dir, "sft")
    t = time.perf_counter()
    before = strict_accuracy(model, tok, val, s["max_response"])
    targets = [json.loads(x)["answer"] for x in sft["extra_info"]]
    cfg = SFTConfig(max_steps=s["sft_steps"], epochs=1000, batch_size=s["sft_batch"], lr=s.get("sft_lr", 3e-5),
                    warmup_steps=min(5, s["sft_steps"]), stop_at_accuracy=0.0, log_every=10, num_threads=1,
                    max_seconds=120)
    # bf16 autocast per step on the GPU (fp32 weights for AdamW); never one region around the
    # whole run, whose weight cache would freeze the forward at step 1's weights
    metrics = sft_warm_start(model, tok, sft["prompt"].tolist(), targets, cfg, prompt_format="chat",
                             autocast_dtype="bfloat16" if device.type == "cuda" else "")
    after = strict_accuracy(model, tok, val, s["max_response"])
    save_model_atomic(model, tok, str(out / "sft_model"))
    print(f"instruct strict {before['strict']:.3f} -> after SFT {after['strict']:.3f}", flush=True)
    return {"instruct": before, "sft": after, "sft_metrics": metrics, "seconds": time.perf_counter() - t}


def lane_command(a, lane: str, s: dict, out: Path, start_dir: str, data_dir: str) -> list[str]:
    script = "benchmarks/real_model_trl.py" if lane == "trl" else "benchmarks/real_model.py"
    cmd = [sys.executable, script, "--lane", lane, "--start", start_dir, "--data", data_dir,
           "--lane-out", str(out / f"{lane}.json"), "--budget", str(s["budget"]), "--eval-every", str(s["eval_every"]),
           "--max-response", str(s["max_response"]), "--seed", str(a.seed)]
    cmd += ["--cpu-smoke"] if a.cpu_smoke else []
    if lane == "ppo":
        cmd += [x for o in a.ppo_override for x in ("--ppo-override", o)]
    else:
        cmd += ["--trl-lr", str(a.trl_lr)]
    return cmd


T0 = time.perf_counter()  # the orchestrator's start: --deadline counts from here


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


def run_lanes(a, s: dict, out: Path, start_dir: str, data_dir: str) -> dict:
    """Both lanes as concurrent processes (logs `<out>/<lane>.log`); their JSON results."""
    import torch

    procs, commands = {}, {}
    gpu = {"DS_ACCELERATOR": "cuda"} if torch.cuda.is_available() and not a.cpu_smoke else {}
    for lane in a.lanes.split(","):
        env = {**os.environ, **ENV, **gpu, "PYTHONPATH": os.pathsep.join(
            p for p in ((a.trl_site if lane == "trl" else ""), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        cmd = lane_command(a, lane, s, out, start_dir, data_dir)
        commands[lane] = " ".join(cmd)
        procs[lane] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(out / f"{lane}.log", "w"),
                                       stderr=subprocess.STDOUT)
    results = {}
    for lane, p in procs.items():
        rc = _wait_until(p, (a.deadline or (1800 if a.cpu_smoke else 540)) - (time.perf_counter() - T0))
        path = out / f"{lane}.json"
        results[lane] = json.loads(path.read_text()) if path.exists() else {"error": f"exit code {rc}"}
        results[lane].update(rc=rc, command=commands[lane])
    return results


# ---------------------------------------------------------------------------------
# The PPO lane (this project's in-process driver)
# ---------------------------------------------------------------------------------


def ppo_config(a, s: dict):
    from rlhf.config import load_config

    d = a.data
    overrides = [f"model.path={a.start}", f"data.train_files={d}/train.parquet", f"data.val_files={d}/test.parquet",
                 f"data.max_response_length={s['max_response']}", f"reward.format_score={FORMAT_SCORE}",
                 f"trainer.output_dir={Path(a.lane_out).parent / 'ppo_run'}", f"trainer.seed={a.seed}",
                 "trainer.total_rounds=100000", "trainer.test_freq=100000", "trainer.val_before_train=false"]
    if a.cpu_smoke:
        overrides += ["trainer.device=cpu", "deepspeed.bf16=false", "model.dtype=float32", "trainer.num_threads=1", "data.train_batch_size=2", "rollout.n=2",
                      "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=1", "critic.ppo_epochs=1",
                      "rollout.name=hf"]
    return load_config(str(EXAMPLE_CFG), overrides + list(a.ppo_override))


def run_ppo_lane(a) -> dict:
    """Rounds of `rlhf.train.Run` until the training-time budget, evaluated on the way.
    Round checkpoints are skipped (the HF engines share the trainer's weights, and the
    benchmark measures learning, not checkpoint I/O)."""
    from rlhf.train import Run

    s = sizes(a)
    cfg = ppo_config(a, s)
    run = Run(cfg)
    run.save = lambda: None
    curve = Curve(run.trainer.actor.module, run.tokenizer, load_split(a.data, "test"), s["max_response"],
                  s["eval_every"], "ppo", a.lane_out)
    curve.evaluate(0)
    stop = ""
    while curve.t_train < s["budget"] and not stop:
        t = time.perf_counter()
        verdict = run.round()
        curve.t_train += time.perf_counter() - t
        stop = verdict.reason if verdict.stop else ""
        last = run.state.step_history[-1]
        print(f"round {run.state.round} train {curve.t_train:.0f}s score {last.get('critic/score/mean', 0):.3f} "
              f"kl {last.get('actor/current_kl', float('nan')):.4f}", flush=True)
        if curve.due() or curve.t_train >= s["budget"] or stop:
            curve.evaluate(run.state.global_step)
    run.close()
    from rlhf.config import to_dict

    return {"lane": "ppo", "curve": curve.points, "rounds": run.state.round, "stop_reason": stop,
            "config": to_dict(cfg), "train_s": curve.t_train}


def orchestrate(a) -> int:
    import torch

    from benchmarks import real_model_report as R

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    torch.set_num_threads(1 if a.cpu_smoke else max(1, os.cpu_count() // 2))
    device = torch.device("cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu")
    s = sizes(a) | {"sft_lr": a.sft_lr}
    model_dir = convert(a, out)
    data_dir = write_data(out, s, a.seed)
    warm = warm_start(model_dir, data_dir, s, out, device)
    results = {"command": " ".join([sys.executable, *sys.argv]), "sizes": s, "format_score": FORMAT_SCORE,
               "versions": R.versions(), "machine": R.machine(), "warm_start": warm,
               "prepare_s": time.perf_counter() - t0}
    results["lanes"] = run_lanes(a, s, out, str(out / "sft_model"), data_dir)
    results["wall_s"] = time.perf_counter() - t0
    R.write_results(results, out)
    print((out / "results.md").read_text(), flush=True)
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", help="the SmolLM2-135M-Instruct GGUF file")
    p.add_argument("--gguf-sha256", default=SMOLLM2_SHA256, help="expected sha256 ('' to skip the check)")
    p.add_argument("--out", help="results directory")
    p.add_argument("--cpu-smoke", "--tiny", action="store_true", help="a few steps of both lanes on CPU")
    p.add_argument("--lanes", default="ppo,trl")
    p.add_argument("--trl-site", default="", help="directory with TRL and its dependencies (PYTHONPATH of the TRL lane)")
    p.add_argument("--n-train", type=int, default=5000)
    p.add_argument("--n-val", type=int, default=200)
    p.add_argument("--n-sft", type=int, default=256)
    p.add_argument("--sft-steps", type=int, default=10)
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--sft-lr", type=float, default=3e-5)
    p.add_argument("--max-response", type=int, default=128)
    p.add_argument("--budget", type=float, default=0, help="training seconds per lane (default 270; smoke 40)")
    p.add_argument("--eval-every", type=float, default=0, help="training seconds between evaluations (45; smoke 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=0, help="seconds from the start after which running lanes "
                   "are stopped, their curves so far kept (default 540; smoke 1800)")
    p.add_argument("--ppo-override", action="append", default=[], help="key=value for the PPO lane's config")
    p.add_argument("--trl-lr", type=float, default=1e-5)
    p.add_argument("--lane", choices=("ppo",), help=argparse.SUPPRESS)
    p.add_argument("--start", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--lane-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.lane == "ppo":
        write_json(run_ppo_lane(a), a.lane_out)
        return 0
    if not a.gguf or not a.out:
        sys.exit("error: give --gguf FILE and --out DIR")
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
