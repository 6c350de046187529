"""The in-process driver: every round's stages in one process (or one per rank under torchrun).

    python -m rlhf.train [--cfg FILE] [key=value ...] [--summary-json PATH]
    torchrun --nproc_per_node=2 -m rlhf.train trainer.n_gpus_per_node=2 ...

`train(cfg)` returns the summary dict (also written to `<output_dir>/summary.json`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from rlhf import checkpoint as ckpt
from rlhf import stages
from rlhf.config import PPOConfig, derive_sizes, load_config, save_config
from rlhf.state import RoundState, Verdict, decide, record_steps, record_val
from rlhf.trainer import dist as D

log = logging.getLogger("rlhf.train")


class Run:
    """Everything one driver process holds across rounds."""

    def __init__(self, cfg: PPOConfig):
        from rlhf.models.load import ValueModel, frozen_reference, load_causal_lm, load_tokenizer
        from rlhf.trainer.ppo import PPOTrainer

        self.cfg = cfg
        self.t0 = time.perf_counter()
        self.device = D.pick_device(cfg.trainer.device)
        self.rank, self.world = D.init_distributed(self.device)
        torch.manual_seed(cfg.trainer.seed)
        stages.check_sizes(cfg, self.world)
        self.sizes = derive_sizes(cfg, self.world)
        self.out = Path(cfg.trainer.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.data = stages.prepare_data(cfg)
        if self.rank == 0:
            self.base_dir = stages.prepare_policy(cfg, self.out, self.data)
        D.barrier()
        self.base_dir = D.broadcast_object(self.base_dir if self.rank == 0 else None)
        resume = ckpt.latest_checkpoint(self.out) if cfg.trainer.resume == "auto" else None
        self.resumed_from = str(resume) if resume else ""
        policy_dir = str(resume / "actor") if resume else self.base_dir
        self.tokenizer = load_tokenizer(self.base_dir, trust_remote_code=cfg.model.trust_remote_code)
        actor = load_causal_lm(policy_dir, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
        critic = None
        if cfg.algorithm.adv_estimator == "gae":
            if resume:
                critic = ValueModel.from_pretrained(str(resume / "critic"), dtype=cfg.model.dtype)
            else:
                critic = ValueModel.from_causal_lm_dir(cfg.model.critic_path or self.base_dir, dtype=cfg.model.dtype)
        ref = frozen_reference(self.base_dir, dtype=cfg.model.dtype)
        self.trainer = PPOTrainer(cfg, self.sizes, actor, critic, ref, self.device)
        self.state = RoundState.initial(cfg)
        if resume:
            self._load(resume)
        self.engine = self._make_engine(policy_dir)
        self.reward_model = stages.load_reward_model(cfg, self.device)
        self.sink = self._make_sink()

    # -- set-up helpers ------------------------------------------------------------------
    def _make_engine(self, policy_dir: str):
        from rlhf.rollout import make_engine

        model = self.trainer.actor.module if self.cfg.rollout.name == "hf" else None
        return make_engine(self.cfg.rollout.name, policy_dir, self.tokenizer, self.cfg.rollout, model=model,
                           seed=self.cfg.trainer.seed, device=str(self.device), dtype=self.cfg.model.dtype)

    def _make_sink(self):
        from rlhf.tracking import NullSink, make_sink

        if self.rank != 0:
            return NullSink()
        sink = make_sink(self.cfg.trainer.logger, self.cfg, run_name=self.cfg.trainer.experiment_name)
        from rlhf.config import flatten

        sink.log_params(flatten(self.cfg))
        return sink

    def _load(self, path: Path) -> None:
        self.state = RoundState.from_json((path / ckpt.STATE_FILE).read_text())
        self.trainer.actor.load_checkpoint(str(path / "engine" / "actor"), tag="state",
                                           load_module_strict=True, load_lr_scheduler_states=False)
        if self.trainer.critic is not None:
            self.trainer.critic.load_checkpoint(str(path / "engine" / "critic"), tag="state",
                                                load_module_strict=True, load_lr_scheduler_states=False)
        self.trainer.kl_ctrl.value = self.state.kl_coef
        self.trainer.skipped_steps = self.state.skipped_steps
        log.info("resumed from %s at round %d (global step %d, kl_coef %.5g)", path, self.state.round,
                 self.state.global_step, self.state.kl_coef)

    # -- one round -------------------------------------------------------------------------
    def evaluate(self) -> float:
        metrics = stages.evaluate(self.engine, self.tokenizer, self.data.val, self.cfg, self.reward_model)
        score = stages.val_score(metrics)
        self.state = record_val(self.state, score, self.cfg.early_stop.min_delta)
        self.sink.log_metrics(metrics, step=self.state.global_step)
        return score

    def round(self) -> Verdict:
        cfg, timer = self.cfg, {}
        t = time.perf_counter()
        prompts, self.state = stages.sample_prompts(self.data.train, self.state, cfg)
        prompts = stages.shard(prompts, cfg.trainer.steps_per_round, self.rank, self.world)
        seed = cfg.trainer.seed * 100003 + self.state.round * 1009 + self.rank
        timer["timing_s/gen"] = _lap(t)
        t = time.perf_counter()
        rollouts = stages.rollout(self.engine, self.tokenizer, prompts, cfg, seed=seed)
        timer["timing_s/gen"] += _lap(t)
        t = time.perf_counter()
        scored = stages.score(rollouts, cfg, self.reward_model)
        timer["timing_s/reward"] = _lap(t)
        t = time.perf_counter()
        steps = stages.update(self.trainer, scored, self.tokenizer.pad_token_id, cfg)
        timer["timing_s/update"] = _lap(t)
        gen_metrics = D.mean_across_ranks(stages.rollout_metrics(rollouts, cfg))
        n_tokens = D.all_reduce_sum(torch.tensor(float(sum(len(json.loads(r)) + len(json.loads(p)) for r, p in
                                                          zip(rollouts["response_ids"], rollouts["prompt_ids"])))))
        for i, m in enumerate(steps):
            m.update(gen_metrics)
            m.update({k: v / len(steps) for k, v in timer.items()})
            m.update(_perf(m, float(n_tokens) / len(steps), self.world, self.trainer, self.device))
            self.sink.log_metrics(m, step=self.state.global_step + i + 1)
        self.state = record_steps(self.state, steps)
        self.state.kl_coef = self.trainer.kl_ctrl.value
        self.state.round += 1
        if self.state.round % cfg.trainer.test_freq == 0 or self.state.round == cfg.trainer.total_rounds:
            self.evaluate()
        self.state, verdict = decide(self.state, steps, cfg)
        self.save()
        return verdict

    # -- checkpoints -------------------------------------------------------------------------
    def save(self) -> Path:
        """Write the round checkpoint atomically (all ranks write their optimizer shards)."""
        from rlhf.models.load import save_model_atomic
        from rlhf.trainer.engines import full_state_dict

        root = ckpt.checkpoint_root(self.out)
        tmp, final = ckpt.tmp_dir_for(root, self.state.round), root / ckpt.round_dir_name(self.state.round)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        D.barrier()
        self.trainer.actor.save_checkpoint(str(tmp / "engine" / "actor"), tag="state")
        if self.trainer.critic is not None:
            self.trainer.critic.save_checkpoint(str(tmp / "engine" / "critic"), tag="state")
        actor_sd = full_state_dict(self.trainer.actor)
        critic_sd = full_state_dict(self.trainer.critic) if self.trainer.critic is not None else None
        if self.rank == 0:
            _save_module(self.trainer.actor.module, actor_sd, self.tokenizer, tmp / "actor", save_model_atomic)
            if critic_sd is not None:
                _save_module(self.trainer.critic.module, critic_sd, self.tokenizer, tmp / "critic",
                             save_model_atomic)
            save_config(self.cfg, tmp / "config.yaml")
            (tmp / ckpt.STATE_FILE).write_text(self.state.to_json())
            ckpt.commit(tmp, final)
            ckpt.prune(self.out, self.cfg.trainer.max_ckpt_to_keep)
        D.barrier()
        if self.cfg.rollout.name != "hf":
            self.engine.update_weights(str(final / "actor"))
        return final

    def close(self) -> None:
        self.engine.close()
        self.sink.close()


def _save_module(module, state_dict, tokenizer, path: Path, save_model_atomic) -> None:
    if hasattr(module, "save_pretrained") and not hasattr(module, "value_head"):
        module.save_pretrained(str(path), state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(str(path))
    else:
        save_model_atomic(module, tokenizer, str(path))


def _lap(t: float) -> float:
    return time.perf_counter() - t


def _perf(m: dict[str, float], tokens: float, world: int, trainer, device: torch.device) -> dict[str, float]:
    """Throughput (tokens per second per GPU over the update) and actor MFU from 6 * params * tokens."""
    upd = m.get("timing_s/update", 0.0)
    out = {"perf/total_num_tokens": tokens}
    if upd > 0:
        out["perf/throughput"] = tokens / upd / world
        n_params = sum(p.numel() for p in trainer.actor.module.parameters())
        actor_t = m.get("timing_s/update_actor", upd)
        peak = _peak_flops(device)
        if peak and actor_t > 0:
            out["perf/mfu/actor"] = 6.0 * n_params * tokens * trainer.cfg.actor.ppo_epochs / actor_t / world / peak
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        import resource

        out["perf/cpu_memory_used_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def _peak_flops(device: torch.device) -> float:
    """Dense bf16 peak of the device in FLOP/s ($RLHF_PEAK_TFLOPS overrides; 790 measured on H200)."""
    if os.environ.get("RLHF_PEAK_TFLOPS"):
        return float(os.environ["RLHF_PEAK_TFLOPS"]) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return 790e12 if "H200" in name or "H100" in name else 312e12
    return 0.0


def train(cfg: PPOConfig) -> dict:
    """Run PPO rounds until `trainer.total_rounds` or an early stop; returns the summary."""
    run = Run(cfg)
    try:
        if cfg.trainer.val_before_train and run.state.round == 0 and run.state.val_start < 0:
            run.evaluate()
        verdict = Verdict(stop=bool(run.state.stop_reason), reason=run.state.stop_reason)
        while run.state.round < cfg.trainer.total_rounds and not verdict.stop:
            verdict = run.round()
            _progress(run)
        summary = _summary(run, verdict)
        if run.rank == 0:
            path = run.out / "summary.json"
            path.write_text(json.dumps(summary, indent=2))
            run.sink.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))},
                                 step=run.state.global_step)
            run.sink.log_artifact(str(path))
            last = ckpt.latest_checkpoint(run.out)
            if last is not None:
                run.sink.log_artifact(str(last / "actor"), artifact_path="final_model")
        return summary
    finally:
        run.close()


def _progress(run: Run) -> None:
    if run.rank != 0:
        return
    s = run.state
    last = s.step_history[-1] if s.step_history else {}
    print(f"round {s.round}/{run.cfg.trainer.total_rounds} step {s.global_step} "
          f"score {last.get('critic/score/mean', float('nan')):.3f} val {s.last_val:.3f} "
          f"kl {last.get('actor/current_kl', float('nan')):.4f} kl_coef {s.kl_coef:.4g} "
          f"{time.perf_counter() - run.t0:.0f}s", flush=True)


def _summary(run: Run, verdict: Verdict) -> dict:
    s = run.state
    return {
        "val_score_start": s.val_start,
        "val_score_end": s.last_val,
        "val_score_best": s.best_val,
        "rounds": s.round,
        "global_steps": s.global_step,
        "stop_reason": verdict.reason or ("total_rounds reached" if s.round >= run.cfg.trainer.total_rounds
                                          else ""),
        "kl_coef": s.kl_coef,
        "skipped_steps": s.skipped_steps,
        "wall_s": time.perf_counter() - run.t0,
        "resumed_from": run.resumed_from,
        "world_size": run.world,
        "output_dir": str(run.out),
        "val_history": s.val_history,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", help="YAML or JSON config file (verl-style keys)")
    p.add_argument("--summary-json", help="also write the summary here")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.clip_ratio=0.3")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.cfg, args.overrides)
    summary = train(cfg)
    if args.summary_json and D.world()[0] == 0:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    if D.world()[0] == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "val_history"}, indent=2))
    return 0


class _CallableModule(type(sys)):
    """Lets `rlhf.train(cfg)` call `train(cfg)` while `python -m rlhf.train` stays a module."""

    def __call__(self, cfg: PPOConfig) -> dict:
        return train(cfg)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
