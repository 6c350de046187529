"""The rules both drivers follow, so that the same config and seed give the same rounds
whether one process runs them (`rlhf.train.inprocess`) or one task per stage does
(`rlhf.train.stateless`): the rollout and update seeds, the validation schedule, the state
after an update, the per-step metrics (throughput, MFU) and the metrics
table. A driver takes the rounds of offline RLHF from `rlhf.round.offline` itself.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import pandas as pd
import torch

from rlhf.config.schema import PPOConfig
from rlhf.round.state import RoundState, record_steps
from rlhf.trainer import dist as D

log = logging.getLogger("rlhf.train")


def rollout_seed(cfg: PPOConfig, round_: int, rank: int = 0) -> int:
    """The sampling seed of round `round_` (rounds completed before it) on `rank`."""
    return cfg.trainer.seed * 100003 + round_ * 1009 + rank


def update_seed(cfg: PPOConfig, round_: int, rank: int = 0) -> int:
    """The global torch seed of round `round_`'s update on `rank` (dropout draws from it): a
    function of the round alone, so a resumed run draws what an uninterrupted one would."""
    return rollout_seed(cfg, round_, rank) + 7919


def should_evaluate(cfg: PPOConfig, rounds_done: int) -> bool:
    """Validate after round `rounds_done` (1-based): every `test_freq` rounds and after the last;
    never with `test_freq=-1`."""
    if cfg.trainer.test_freq <= 0:
        return False
    return rounds_done % cfg.trainer.test_freq == 0 or rounds_done == cfg.trainer.total_rounds


def should_validate_first(cfg: PPOConfig, state: RoundState) -> bool:
    """Validate the starting policy before any update (`trainer.val_before_train`; with
    `test_freq=-1` too, as verl validates before training whatever its test_freq)."""
    return cfg.trainer.val_before_train and state.round == 0 and state.val_start < 0


def record_update(state: RoundState, steps: list[dict[str, float]], kl_coef: float) -> RoundState:
    """The state after a round's update: step history, global step, KL coefficient, round + 1."""
    new = record_steps(state, steps)
    return replace(new, kl_coef=float(kl_coef), round=state.round + 1)


def warn_if_unrewarded(scored: pd.DataFrame, round_: int, rank: int = 0) -> str:
    """In the run's first round (`round_` 1), `unrewarded_warning` logged by rank 0 when no
    rank's response scored anything but 0; returns it ("" otherwise). All ranks call it."""
    if round_ != 1:
        return ""
    rewarded = D.all_reduce_max(torch.tensor(float((scored["score"] != 0).any()))).item() > 0
    message = "" if rewarded else unrewarded_warning(scored)
    if message and rank == 0:
        log.warning("%s", message)
    return message


def unrewarded_warning(scored: pd.DataFrame, n: int = 3, tail: int = 80) -> str:
    """A warning when every response in `scored` scored exactly 0 although rule-scored rows carry
    ground truths, with `n` examples (the prompt's and the response's last `tail` characters,
    the ground truth); "" otherwise. Such a run trains on no reward at all, most often because
    the ground truths are not in the form the rule compares (text: "86", not "86.0")."""
    truths = scored[(scored["reward_style"] == "rule") & scored["ground_truth"].notna()]
    if truths.empty or (scored["score"] != 0).any():
        return ""
    shown = truths.drop_duplicates("prompt").head(n)
    examples = "\n".join(f"  prompt ...{str(r.prompt)[-tail:]!r}\n  response ...{str(r.response)[-tail:]!r}\n"
                          f"  ground truth {r.ground_truth!r}" for r in shown.itertuples())
    return (f"every one of the {len(scored)} responses of the first round scored exactly 0, although {len(truths)} "
            "of them have a ground truth: the run is training on no reward. Check that the ground truths are in the "
            "form the responses' answers take (the rule rewards compare text, as verl's do) and that data_source "
            f"picks the right reward. Examples:\n{examples}")


def step_metrics(steps: list[dict[str, float]], gen: dict[str, float], timing: dict[str, float], tokens: float,
                 world: int, trainer, device: torch.device) -> list[dict[str, float]]:
    """Each PPO step's metrics completed with the round's rollout metrics, its share of the
    round's stage timings (and their sum, `timing_s/step`), throughput and MFU."""
    out = []
    for m in steps:
        m = {**m, **gen, **{k: v / len(steps) for k, v in timing.items()},
             "timing_s/step": sum(timing.values()) / len(steps)}
        m.update(perf_metrics(m, tokens / len(steps), world, trainer, device))
        out.append(m)
    return out


def perf_metrics(m: dict[str, float], tokens: float, world: int, trainer, device: torch.device
                 ) -> dict[str, float]:
    """Throughput (tokens per second per GPU over the update) and actor MFU: per token, 2 FLOPs per
    parameter forward, 2 backward to the activations and 2 more for a trainable parameter's
    gradient (6 x params in full; about 4 x params with LoRA, whose base weights get no gradient)."""
    upd = m.get("timing_s/update", 0.0)
    out = {"perf/total_num_tokens": tokens}
    if upd > 0:
        out["perf/throughput"] = tokens / upd / world
        params = list(trainer.actor.module.parameters())
        flops_per_token = 4.0 * sum(p.numel() for p in params) + 2.0 * sum(p.numel() for p in params if p.requires_grad)
        actor_t = m.get("timing_s/update_actor", upd)
        peak = peak_flops(device)
        if peak and actor_t > 0:
            out["perf/mfu/actor"] = flops_per_token * tokens * trainer.cfg.actor.ppo_epochs / actor_t / world / peak
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        import resource

        out["perf/cpu_memory_used_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def peak_flops(device: torch.device) -> float:
    """Dense bf16 peak of the device in FLOP/s ($RLHF_PEAK_TFLOPS overrides; 790 measured on H200)."""
    if os.environ.get("RLHF_PEAK_TFLOPS"):
        return float(os.environ["RLHF_PEAK_TFLOPS"]) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return 790e12 if "H200" in name or "H100" in name else 312e12
    return 0.0


def metrics_table(state: RoundState) -> pd.DataFrame:
    """One row per PPO step (`step` and the history metrics), plus one row per validation
    without a step of its own (e.g. before training); `val/score` where validated."""
    steps = pd.DataFrame(state.step_history or {"step": []})
    vals = pd.DataFrame({"step": [v["step"] for v in state.val_history],
                         "val/score": [v["score"] for v in state.val_history]})
    table = steps.merge(vals, on="step", how="outer").sort_values("step", kind="stable").reset_index(drop=True)
    table["step"] = table["step"].astype("int64")
    return table
