"""The TRL lane of benchmarks/real_model.py: TRL's GRPOTrainer from the same SFT start, on the
same train prompts, with the same reward, training-time budget and evaluation.

Started by real_model.py as its own process (TRL and its dependencies on PYTHONPATH for
this lane only). Settings follow TRL's GRPO defaults where the peer measurement in the
real-model notes used them: 8 prompts x 8 generations a step, HF generation, bf16 on GPU,
`beta=0` (TRL's default: no reference model), learning rate `--trl-lr` (1e-5).
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

from benchmarks.real_model import Curve, load_split, reward, sizes, write_json  # noqa: E402


def completion_text(completion) -> str:
    """TRL passes conversational completions as [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion)
    return str(completion)


def strict_reward(completions, ground_truth, **kwargs) -> list[float]:
    return [reward(completion_text(c), g) for c, g in zip(completions, ground_truth)]


def dataset(data_dir: str):
    from datasets import Dataset

    train = load_split(data_dir, "train")
    return Dataset.from_list([{"prompt": json.loads(p), "ground_truth": str(g)}
                              for p, g in zip(train["prompt"], train["ground_truth"])])


def grpo_args(a, s: dict, out_dir: str, on_cpu: bool):
    import torch
    from trl import GRPOConfig

    prompts, n = (2, 2) if a.cpu_smoke else (8, 8)
    return GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=prompts * n, num_generations=n,
        gradient_accumulation_steps=1, max_completion_length=s["max_response"], learning_rate=a.trl_lr,
        temperature=1.0, bf16=not on_cpu, use_cpu=on_cpu, report_to="none", save_strategy="no",
        logging_steps=10**6, max_steps=10**6, seed=a.seed, disable_dropout=True,
        model_init_kwargs={"dtype": torch.float32 if on_cpu else torch.bfloat16})


def budget_callback(curve: Curve, budget: float):
    """A TrainerCallback that clocks training time between steps, evaluates when due (its
    time not counted) and stops at the budget."""
    from transformers import TrainerCallback

    class Budget(TrainerCallback):
        def __init__(self):
            self.t = None

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            curve.t_train += time.perf_counter() - self.t
            if curve.due() or curve.t_train >= budget:
                curve.evaluate(state.global_step)
            if curve.t_train >= budget:
                control.should_training_stop = True
            return control

    return Budget()


def run_trl_lane(a) -> dict:
    import torch
    import trl
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    s = sizes(a)
    on_cpu = a.cpu_smoke or not torch.cuda.is_available()
    torch.set_num_threads(1) if on_cpu else None
    tok = AutoTokenizer.from_pretrained(a.start, local_files_only=True)
    out_dir = str(Path(a.lane_out).parent / "trl_run")
    trainer = GRPOTrainer(model=a.start, reward_funcs=[strict_reward], args=grpo_args(a, s, out_dir, on_cpu),
                          train_dataset=dataset(a.data), processing_class=tok)
    curve = Curve(trainer.model, tok, load_split(a.data, "test"), s["max_response"], s["eval_every"], "trl",
                  a.lane_out)
    curve.evaluate(0)
    trainer.add_callback(budget_callback(curve, s["budget"]))
    trainer.train()
    return {"lane": "trl", "curve": curve.points, "steps": trainer.state.global_step, "train_s": curve.t_train,
            "trl": trl.__version__, "args": {k: str(v) for k, v in trainer.args.to_dict().items()
                                              if k in ("per_device_train_batch_size", "num_generations",
                                                       "learning_rate", "beta", "max_completion_length",
                                                       "temperature", "loss_type", "bf16")}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("--lane", "--start", "--data", "--lane-out"):
        p.add_argument(flag, required=True)
    p.add_argument("--budget", type=float, default=0)
    p.add_argument("--eval-every", type=float, default=0)
    p.add_argument("--max-response", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-lr", type=float, default=1e-5)
    p.add_argument("--cpu-smoke", "--tiny", action="store_true")
    a = p.parse_args(argv)
    a.n_train = a.n_val = a.n_sft = a.sft_steps = a.sft_batch = 0  # sizes() reads only the lane's settings
    write_json(run_trl_lane(a), a.lane_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
