"""The TRL lanes of benchmarks/real_model.py: TRL's GRPOTrainer from the same SFT start, on the
same train prompts, with the same reward, training-time budget and evaluation as the PPO lane.

Started by real_model.py as its own process (TRL and its dependencies may come on PYTHONPATH
for this lane only). Two lanes:
- `trl`: TRL as its users run it. TRL 1.16's defaults where it has them (checked in its
  `GRPOConfig`): the policy given as a path loads in float32 and trains under bf16 autocast,
  `beta=0` (no reference model), `loss_type="dapo"`, `scale_rewards="group"`, one iteration,
  `epsilon=0.2`, temperature 1.0, 8 generations a prompt. What is set is listed with its
  reason in `SETTINGS`.
- `trl_ppo_schedule`: the same, with the PPO lane's sample and update budget: its prompts and
  responses per generation, its mini-batch per update, its passes over each generation.
Every argument of the trainer (defaults included) goes into the lane's results.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.real_model_common import (Curve, lane_parser, load_split, ppo_config, ppo_schedule,  # noqa: E402
                                          gpu_memory, reward, seed_everything, write_json)

# Settings both TRL lanes set, with their reasons (the values come from `settings`).
SETTINGS = {
    "learning_rate": "the PPO actor's learning rate (--trl-lr overrides), so the lanes differ in algorithm, not "
                     "step size; TRL 1.16's default is 1e-6",
    "max_completion_length": "the PPO lane's data.max_response_length: the same response budget",
    "temperature": "TRL's default 1.0, also the PPO lane's rollout.temperature",
    "per_device_train_batch_size": "completions per optimizer step = the PPO lane's mini-batch (ppo_mini_batch_size "
                                   "x rollout.n), so each update sees as many samples as one PPO update",
    "gradient_accumulation_steps": "1, TRL's default: one micro-batch per update",
    "gradient_checkpointing": "off: TRL's default (on) recomputes activations to save memory; a 135M policy fits "
                              "without it and the PPO lane does not recompute them, so on it would only cost time "
                              "in a timed comparison",
    "lr_scheduler_type": "constant, as the PPO actor's: the lane is stopped by training time, not by max_steps, so "
                         "the default linear decay to max_steps would have no meaning",
    "max_steps": "a cap never reached: the budget callback stops the lane",
    "logging_steps": "1: every step's TRL metrics (reward, frac_reward_zero_std, kl, entropy) go to the results",
    "seed": "the run's --seed (prompt order, sampling)",
    "bf16": "TRL's default on GPU (bf16 autocast over float32 weights); off in the CPU smoke run",
    "use_cpu": "only in the CPU smoke run",
    "save_strategy": "no: the final policy is saved once, after the budget",
    "report_to": "none: the results JSON holds the log",
    "model_init_kwargs": "not set: TRL 1.16 loads a policy given as a path in float32 (GRPOTrainer's docstring), "
                         "so AdamW updates float32 weights",
}
SCHEDULE_SETTINGS = {
    "num_generations": "TRL's default 8 in `trl`; the PPO lane's rollout.n in `trl_ppo_schedule`",
    "steps_per_generation": "TRL's default (= gradient_accumulation_steps, one update per generation) in `trl`; "
                            "the PPO lane's mini-batches per generation in `trl_ppo_schedule`",
    "num_iterations": "TRL's default 1 in `trl`; the PPO lane's actor.ppo_epochs in `trl_ppo_schedule`",
}


def settings(lane: str, sched: dict, lr: float, max_response: int, seed: int, on_cpu: bool, smoke: bool) -> dict:
    """GRPOConfig's keyword arguments of `lane` (besides output_dir)."""
    update = sched["update_samples"]
    if lane == "trl":
        n = 2 if smoke else 8
        schedule = {"num_generations": n, "per_device_train_batch_size": max(update, n) // n * n}
    else:
        schedule = {"num_generations": sched["n"], "per_device_train_batch_size": update,
                    "steps_per_generation": sched["samples"] // update, "num_iterations": sched["epochs"]}
    return schedule | {
        "learning_rate": lr, "max_completion_length": max_response, "temperature": sched["temperature"],
        "gradient_accumulation_steps": 1, "gradient_checkpointing": False, "lr_scheduler_type": "constant",
        "max_steps": 10**6, "logging_steps": 1, "seed": seed, "bf16": not on_cpu, "use_cpu": on_cpu,
        "save_strategy": "no", "report_to": "none"}


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


def budget_callback(curve: Curve, budget: float, per_generation: dict):
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
                rounds = state.global_step // per_generation["updates"]
                curve.evaluate(state.global_step, rounds, rounds * per_generation["samples"])
            if curve.t_train >= budget:
                control.should_training_stop = True
            return control

    return Budget()


def args_record(args) -> dict:
    """Every GRPOConfig argument as JSON-ready values, and those that differ from TRL's defaults."""
    from trl import GRPOConfig

    every = {k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v) for k, v in args.to_dict().items()}
    default = GRPOConfig(output_dir=args.output_dir, use_cpu=args.use_cpu).to_dict()
    changed = {k: [every[k], default.get(k)] for k in every
               if str(every[k]) != str(default.get(k)) and k not in ("logging_dir",)}
    return {"every": every, "changed_from_default": changed}


def log_summary(log: list[dict]) -> dict:
    """Means over the lane's logged steps of the metrics TRL logs once per generation."""
    out = {}
    for key in ("frac_reward_zero_std", "reward", "reward_std", "kl", "entropy", "completions/mean_length",
                "completions/clipped_ratio"):
        values = [e[key] for e in log if key in e]
        if values:
            out[key] = {"mean": sum(values) / len(values), "logged": len(values)}
    return out


def run_trl_lane(a) -> dict:
    import torch
    import trl
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.models.load import save_model_atomic

    seed_everything(a.seed)
    sched = ppo_schedule(ppo_config(a))
    on_cpu = a.cpu_smoke or not torch.cuda.is_available()
    torch.set_num_threads(1) if on_cpu else None
    kwargs = settings(a.lane, sched, a.trl_lr or sched["lr"], a.max_response, a.seed, on_cpu, a.cpu_smoke)
    args = GRPOConfig(output_dir=str(Path(a.lane_out).parent / f"{a.lane}_run"), **kwargs)
    per_generation = {"samples": args.generation_batch_size,
                      "updates": args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps}
    tok = AutoTokenizer.from_pretrained(a.start, local_files_only=True)
    trainer = GRPOTrainer(model=a.start, reward_funcs=[strict_reward], args=args, train_dataset=dataset(a.data_dir),
                          processing_class=tok)
    curve = Curve(trainer.model, tok, load_split(a.data_dir, "test"), a.max_response, a.eval_every, a.lane,
                  a.lane_out)
    curve.evaluate(0, 0, 0)
    trainer.add_callback(budget_callback(curve, a.budget, per_generation))
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    policy = save_model_atomic(model, tok, a.policy_out)
    log = trainer.state.log_history
    reasons = {k: SETTINGS.get(k) or SCHEDULE_SETTINGS.get(k) for k in [*kwargs, "model_init_kwargs"]}
    return {"lane": a.lane, "curve": curve.points, "steps": trainer.state.global_step,
            "rounds": trainer.state.global_step // per_generation["updates"], "train_s": curve.t_train,
            "trl": trl.__version__, "schedule": per_generation | {"ppo_lane": sched}, "policy": policy,
            "policy_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "gpu_memory": gpu_memory(),
            "settings": {"set": kwargs, "reasons": reasons, "args": args_record(trainer.args)},
            "log_summary": log_summary(log), "log": log}


def main(argv=None) -> int:
    a = lane_parser(__doc__.split("\n")[0]).parse_args(argv)
    write_json(run_trl_lane(a), a.lane_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
