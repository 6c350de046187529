"""The PPO lane of benchmarks/real_model.py: this project's in-process driver (`rlhf.train.Run`)
with examples/smollm2_gsm8k_1gpu.yaml, from the SFT start, for a budget of training seconds.

Started by real_model.py as its own process. A round is the driver's update and its decision
(`Run.update_round`, `Run.end_round`) without its checkpoint policy: the HF engine shares the
trainer's weights and the lane measures learning, not checkpoint I/O. The final policy is saved
to `--policy-out` after the budget, outside the timed training (the `ppo_lora` lane's with its
adapters merged in: a plain model directory, as every lane's).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.real_model_common import (Curve, lane_parser, load_split, ppo_config, ppo_schedule,  # noqa: E402
                                          gpu_memory, seed_everything, write_json)

ROUND_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/current_kl", "actor/entropy",
              "actor/grad_norm", "critic/vf_loss", "response_length/mean", "response_length/clip_ratio")


def zero_spread_fraction(scored) -> float:
    """Fraction of the round's prompt groups whose responses all scored the same."""
    if scored is None or not {"group_id", "score"} <= set(scored.columns):
        return float("nan")
    return float((scored.groupby("group_id")["score"].nunique() == 1).mean())


def round_record(run, result, t_train: float) -> dict:
    """The round's metrics (its last PPO step's, and the zero-spread fraction of its groups);
    `result` the round's update (`rlhf.train.step.StepResult`)."""
    last = run.state.step_history[-1] if run.state.step_history else {}
    out = {"round": run.state.round, "global_step": run.state.global_step, "train_s": round(t_train, 2),
           "frac_groups_zero_spread": zero_spread_fraction(result.scored)}
    return out | {k: float(last[k]) for k in ROUND_KEYS if k in last}


def run_ppo_lane(a) -> dict:
    """Rounds until the training-time budget, evaluated every `eval_every` training seconds."""
    from rlhf.checkpoint.rounds import save_policy
    from rlhf.config import to_dict
    from rlhf.models.load import save_model_atomic
    from rlhf.models.lora import has_adapters
    from rlhf.train import Run

    seed_everything(a.seed)
    cfg = ppo_config(a)
    sched = ppo_schedule(cfg)
    run = Run(cfg)
    curve = Curve(run.trainer.actor.module, run.tokenizer, load_split(a.data_dir, "test"), a.max_response,
                  a.eval_every, a.lane, a.lane_out)
    curve.evaluate(0, 0, 0)
    stop, history = "", []
    while curve.t_train < a.budget and not stop:
        t = time.perf_counter()
        result = run.update_round()
        verdict = run.end_round(result.steps)
        curve.t_train += time.perf_counter() - t
        stop = verdict.reason if verdict.stop else ""
        history.append(round_record(run, result, curve.t_train))
        print(f"round {run.state.round} train {curve.t_train:.0f}s "
              f"score {history[-1].get('critic/score/mean', 0):.3f} "
              f"zero-spread groups {history[-1]['frac_groups_zero_spread']:.2f}", flush=True)
        if curve.due() or curve.t_train >= a.budget or stop:
            curve.evaluate(run.state.global_step, run.state.round, run.state.round * sched["samples"])
    module = run.trainer.actor.module
    if has_adapters(module):  # a plain model directory with the adapters merged in, as the other lanes'
        out = Path(a.policy_out)
        merged = save_policy(out.parent / f".{out.name}_merged", run.trainer.actor, run.tokenizer)
        shutil.rmtree(out, ignore_errors=True)
        policy = str((merged / "actor").rename(out))
        shutil.rmtree(merged)
    else:
        policy = save_model_atomic(module, run.tokenizer, a.policy_out)
    run.close()
    return {"lane": a.lane, "curve": curve.points, "rounds": run.state.round, "steps": run.state.global_step,
            "stop_reason": stop, "train_s": curve.t_train, "schedule": sched, "history": history,
            "policy": policy, "policy_dtype": str(next(module.parameters()).dtype).removeprefix("torch."),
            "gpu_memory": gpu_memory(),
            "settings": {"source": "examples/smollm2_gsm8k_1gpu.yaml (reasons in its comments) with the "
                                   "run's data, start, sizes and seed", "config": to_dict(cfg)}}


def main(argv=None) -> int:
    a = lane_parser(__doc__.split("\n")[0]).parse_args(argv)
    write_json(run_ppo_lane(a), a.lane_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
