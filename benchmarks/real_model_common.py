"""What every lane of benchmarks/real_model.py shares: the tasks, the reward, the evaluator,
the evaluation curve, the PPO lane's configuration (the TRL lanes read its schedule) and the
lane processes' command line."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EXAMPLE_CFG = ROOT / "examples" / "smollm2_gsm8k_1gpu.yaml"
FORMAT_SCORE = 0.1  # reward of a well-formed (`#### N`) wrong answer, in every lane
ENV = {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
LANES = ("ppo", "trl", "trl_ppo_schedule", "ppo_lora")
DEFAULT_LANES = ("ppo", "trl", "trl_ppo_schedule")
PPO_LANES = ("ppo", "ppo_lora")
# The `ppo_lora` lane: the PPO lane with LoRA adapters of this rank on every linear layer of the
# actor and of the critic (value head trained in full), alpha equal to the rank, and learning
# rates ten times the full fine-tune's: LoRA's usual correction, since an adapter's update is a
# low-rank product that starts at zero (Schulman et al., "LoRA Without Regret", 2025).
LORA_RANK, LORA_LR_FACTOR = 32, 10.0

# The problem generators: their data module and the token budgets their problems need with
# SmolLM2's tokenizer (chat template included). Word problems: prompts <= 82 tokens, worked
# answers <= 50. gsm_symbolic: prompts <= 188, answers 88 at the median, 22% over 128, 0.5% over 256.
# SFT steps (of 8 problems) of the warm-start: on gsm_symbolic, 10 steps left the start at
# strict 0.000 and 0.005 (seeds 0 and 1, one H100), where no lane has a signal to learn from;
# 96 steps (three passes over the 256 labeled problems) gave 0.030
# (benchmarks/results/real_model_h100/gsm_symbolic_first_attempt/).
#
# PPO overrides per task (before `--ppo-override`): gsm_symbolic's 512-token sequences need more
# than the 21 GiB an 80 GB GPU leaves the PPO lane beside the two TRL lanes (28.3 and 28.6 GiB at
# their peaks) with the example's micro-batch of 64 responses: seed 0 ran out of memory in its first
# update, holding 23.0 GiB (benchmarks/results/real_model_h100/gsm_symbolic_second_attempt/).
# Micro-batches of 16 accumulate the same mini-batch of 64 responses in four passes: the same
# update, less activation memory.
TASKS = {
    "word_problems": {"module": "rlhf.data.word_problems", "max_prompt": 192, "max_response": 128, "sft_steps": 10,
                      "ppo_override": []},
    "gsm_symbolic": {"module": "rlhf.data.gsm_symbolic", "max_prompt": 256, "max_response": 256, "sft_steps": 96,
                     "ppo_override": ["actor.ppo_micro_batch_size_per_gpu=16",
                                      "critic.ppo_micro_batch_size_per_gpu=16"]},
}
OTHER = {"word_problems": "gsm_symbolic", "gsm_symbolic": "word_problems"}  # the held-out generator


def write_task(task: str, out_dir: str, sizes: dict[str, int], seed: int) -> str:
    """`task`'s splits (`{split: rows}`) as verl-layout parquet files in `out_dir`."""
    importlib.import_module(TASKS[task]["module"]).write_splits(out_dir, sizes, seed=seed)
    return out_dir


def load_split(data_dir: str, split: str):
    """A split as the flat prompt table (chat list as JSON in `prompt`)."""
    from rlhf.data.io import read_prompts

    return read_prompts(os.path.join(data_dir, f"{split}.parquet"))


def reward(response: str, ground_truth: str) -> float:
    """verl's strict GSM8K score with a small score for a well-formed wrong answer."""
    from rlhf.rewards.gsm8k import compute_score

    return compute_score(response, str(ground_truth), "strict", format_score=FORMAT_SCORE)


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy `p` measured on `n` problems."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def strict_accuracy(model, tokenizer, val, max_response: int) -> dict:
    """Greedy decoding of every problem of `val`: strict and flexible GSM8K accuracy (the
    project's scorer), the strict accuracy's standard error, the mean response length.
    `model` keeps its device and its train/eval mode."""
    from rlhf.data.sampling import encode_prompts
    from rlhf.rewards.gsm8k import compute_score
    from rlhf.rollout.base import SamplingParams
    from rlhf.rollout.hf import HFRolloutEngine

    device = next(model.parameters()).device
    engine = HFRolloutEngine(model, tokenizer, batch_size=256, device=device)
    ids = encode_prompts(val["prompt"].tolist(), tokenizer, "chat")
    out = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_response))
    gts = [str(g) for g in val["ground_truth"]]
    n = len(gts)
    strict = sum(compute_score(t, g, "strict") for t, g in zip(out.response_text, gts)) / n
    flexible = sum(compute_score(t, g, "flexible") for t, g in zip(out.response_text, gts)) / n
    return {"strict": strict, "strict_se": binomial_se(strict, n), "flexible": flexible, "n": n,
            "response_length": sum(len(r) for r in out.response_ids) / n, "sample": out.response_text[0]}


class Curve:
    """Evaluations of one lane against its training time (evaluation time excluded) and its
    rounds (one round: one generation and the updates over it). Each evaluation is written to
    `path` at once, so a lane cut short keeps its curve."""

    def __init__(self, model, tokenizer, val, max_response: int, eval_every: float, lane: str = "",
                 path: str = ""):
        self.model, self.tokenizer, self.val, self.max_response = model, tokenizer, val, max_response
        self.eval_every, self.next_eval, self.points = eval_every, 0.0, []
        self.t_train, self.t0 = 0.0, time.perf_counter()
        self.lane, self.path = lane, path

    def due(self) -> bool:
        return self.t_train >= self.next_eval

    def evaluate(self, step: int, round_: int, samples: int) -> dict:
        t = time.perf_counter()
        point = {"step": step, "round": round_, "samples": samples, "train_s": round(self.t_train, 2),
                 **strict_accuracy(self.model, self.tokenizer, self.val, self.max_response)}
        point["eval_s"] = round(time.perf_counter() - t, 2)
        point["wall_s"] = round(time.perf_counter() - self.t0, 2)
        self.points.append(point)
        self.next_eval = self.t_train + self.eval_every
        if self.path:
            write_json({"lane": self.lane, "curve": self.points, "train_s": self.t_train, "partial": True}, self.path)
        print(f"eval {self.lane} round {round_} step {step} train {self.t_train:.0f}s strict {point['strict']:.3f} "
              f"flexible {point['flexible']:.3f} len {point['response_length']:.0f}", flush=True)
        return point


def write_json(obj: dict, path: str | Path) -> None:
    """`obj` as JSON at `path`, atomically (a temp file, then a rename)."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def gpu_memory() -> dict:
    """This process's peak GPU memory and the device's free memory now (GiB; {} without CUDA):
    what a lane needs beside the others."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    gib = 2**30
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 2),
            "free_gib": round(free / gib, 2), "device_total_gib": round(total / gib, 2),
            "device": torch.cuda.get_device_name()}


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------
# The PPO lane's configuration and schedule
# ---------------------------------------------------------------------------------


def ppo_config(a):
    """The PPO lane's config: examples/smollm2_gsm8k_1gpu.yaml with this run's data, start,
    sizes and seed (`--cpu-smoke`: a few tiny rounds on CPU), then `--ppo-override`s."""
    from rlhf.config import load_config

    d = a.data_dir
    overrides = [f"model.path={a.start}", f"data.train_files={d}/train.parquet", f"data.val_files={d}/test.parquet",
                 f"data.max_response_length={a.max_response}", f"data.max_prompt_length={a.max_prompt}",
                 f"reward.format_score={FORMAT_SCORE}", f"trainer.output_dir={Path(a.lane_out).parent / 'ppo_run'}",
                 f"trainer.seed={a.seed}", "trainer.total_rounds=100000", "trainer.test_freq=100000",
                 "trainer.val_before_train=false"]
    if a.cpu_smoke:
        overrides += ["trainer.device=cpu", "deepspeed.bf16=false", "model.dtype=float32", "trainer.num_threads=1",
                      "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=1",
                      "critic.ppo_epochs=1", "rollout.name=hf"]
    if a.lane == "ppo_lora":
        base = load_config(str(EXAMPLE_CFG), overrides + list(a.ppo_override))
        r = a.lora_rank or LORA_RANK
        overrides += [f"model.lora_rank={r}", f"model.lora_alpha={r}", "model.target_modules=all-linear",
                      f"critic.lora_rank={r}", f"critic.lora_alpha={r}", "critic.target_modules=all-linear",
                      f"actor.lr={base.actor.lr * LORA_LR_FACTOR}", f"critic.lr={base.critic.lr * LORA_LR_FACTOR}"]
    return load_config(str(EXAMPLE_CFG), overrides + list(a.ppo_override))


def ppo_schedule(cfg) -> dict:
    """Samples and optimizer updates per generation of the PPO lane (verl's semantics:
    `ppo_mini_batch_size` counts prompts, each with `rollout.n` responses)."""
    prompts, n = cfg.data.train_batch_size, cfg.rollout.n
    minis = prompts // cfg.actor.ppo_mini_batch_size
    return {"prompts": prompts, "n": n, "samples": prompts * n, "update_samples": cfg.actor.ppo_mini_batch_size * n,
            "epochs": cfg.actor.ppo_epochs, "updates": minis * cfg.actor.ppo_epochs, "lr": cfg.actor.lr,
            "clip_ratio": cfg.actor.clip_ratio, "grad_clip": cfg.actor.grad_clip,
            "weight_decay": cfg.actor.weight_decay, "temperature": cfg.rollout.temperature}


# ---------------------------------------------------------------------------------
# The lane processes' command line (benchmarks/real_model_ppo.py, real_model_trl.py)
# ---------------------------------------------------------------------------------


def lane_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--lane", required=True, choices=LANES)
    p.add_argument("--start", required=True, help="the SFT-warm-started policy directory")
    p.add_argument("--data-dir", required=True, help="train.parquet and test.parquet of the run's task")
    p.add_argument("--lane-out", required=True, help="the lane's results JSON")
    p.add_argument("--policy-out", required=True, help="directory the final policy is saved to")
    p.add_argument("--budget", type=float, required=True, help="training seconds")
    p.add_argument("--eval-every", type=float, required=True, help="training seconds between evaluations")
    p.add_argument("--max-response", type=int, required=True)
    p.add_argument("--max-prompt", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-lr", type=float, default=0.0, help="TRL lanes' learning rate (0: the PPO actor's)")
    p.add_argument("--ppo-override", action="append", default=[], help="key=value for the PPO lane's config "
                   "(the TRL lanes read the PPO schedule from the same config)")
    p.add_argument("--lora-rank", type=int, default=0, help=f"the ppo_lora lane's rank (0: {LORA_RANK})")
    p.add_argument("--cpu-smoke", "--tiny", action="store_true")
    return p
