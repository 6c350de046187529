"""The in-process driver: every round's stages in one process (or one per rank under torchrun).

    python -m rlhf.train [--cfg FILE] [key=value ...] [--summary-json PATH]
    torchrun --nproc_per_node=2 -m rlhf.train trainer.n_gpus_per_node=2 ...

`train(cfg)` returns the summary dict (also written to `<output_dir>/summary.json`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from rlhf import checkpoint as ckpt
from rlhf import pipeline as P
from rlhf import stages
from rlhf.config import ConfigError, PPOConfig, derive_sizes, load_config
from rlhf.state import RoundState, Verdict, decide, record_val
from rlhf.trainer import dist as D

log = logging.getLogger("rlhf.train")


class Run:
    """Everything one driver process holds across rounds."""

    def __init__(self, cfg: PPOConfig):
        from rlhf.models.load import load_options, load_tokenizer

        self.cfg = cfg
        self.t0 = time.perf_counter()
        self.device = D.pick_device(cfg.trainer.device)
        if self.device.type == "cpu" and cfg.trainer.num_threads > 0:
            torch.set_num_threads(cfg.trainer.num_threads)
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
        self.tokenizer = load_tokenizer(self.base_dir, **load_options(cfg.model))
        self.data = stages.fit_data(self.data, self.tokenizer, cfg)
        self.trainer = P.build_trainer(cfg, self.sizes, self.base_dir, self.device, resume)
        self.state = RoundState.initial(cfg)
        if resume:
            self.state = ckpt.restore(self.trainer, resume)
            log.info("resumed from %s at round %d (global step %d, kl_coef %.5g)", resume, self.state.round,
                     self.state.global_step, self.state.kl_coef)
        self._policy_dir, self._engine = policy_dir, None  # the engine is built on first use (`engine`)
        self.offline = P.offline_table(cfg, self.tokenizer)  # the stored rollouts, or None (online)
        self.reward_model = stages.load_reward_model(cfg, self.device)
        self.sink = self._make_sink()
        from rlhf.profiling import StepProfiler

        self.profiler = StepProfiler(cfg.trainer.profile_steps, self.out, self.device, self.rank)

    # -- set-up helpers ------------------------------------------------------------------
    @property
    def engine(self):
        """The rollout engine, built when first asked for: offline training without
        validation never builds one."""
        if self._engine is None:
            self._engine = self._make_engine(self._policy_dir)
        return self._engine

    def _make_engine(self, policy_dir: str):
        from rlhf.models.load import load_options
        from rlhf.rollout import make_engine

        model = self.trainer.actor.module if self.cfg.rollout.name in ("hf", "hf_fast") else None
        return make_engine(self.cfg.rollout.name, policy_dir, self.tokenizer, self.cfg.rollout, model=model,
                           seed=self.cfg.trainer.seed, device=str(self.device), dtype=self.cfg.model.dtype,
                           **load_options(self.cfg.model))

    def _make_sink(self):
        from rlhf.tracking import NullSink, make_sink

        if self.rank != 0:
            return NullSink()
        sink = make_sink(self.cfg.trainer.logger, self.cfg, run_name=self.cfg.trainer.experiment_name)
        from rlhf.config import flatten

        sink.log_params(flatten(self.cfg))
        return sink

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
        seed = P.rollout_seed(cfg, self.state.round, self.rank)
        timer["timing_s/gen"] = _lap(t)
        t = time.perf_counter()
        if self.offline is not None:  # offline RLHF: the stored table stands in for generation
            rollouts, scored = P.offline_round(self.offline, cfg, self.state.round, self.rank, self.world,
                                               self.reward_model)
            timer["timing_s/reward"] = _lap(t)
        else:
            rollouts = stages.rollout(self.engine, self.tokenizer, prompts, cfg, seed=seed)
            timer["timing_s/gen"] += _lap(t)
            t = time.perf_counter()
            scored = stages.score(rollouts, cfg, self.reward_model)
            timer["timing_s/reward"] = _lap(t)
        P.store_rollouts(cfg, scored, self.state.round + 1, self.rank)
        t = time.perf_counter()
        local = self._update_share(scored)
        torch.manual_seed(P.update_seed(cfg, self.state.round, self.rank))
        with self.profiler.update(self.state.global_step + 1, cfg.trainer.steps_per_round, self.sink):
            steps = stages.update(self.trainer, local, self.tokenizer.pad_token_id, cfg)
        timer["timing_s/update"] = _lap(t)
        gen_metrics = D.mean_across_ranks(stages.rollout_metrics(rollouts, cfg))
        n_tokens = float(D.all_reduce_sum(torch.tensor(P.count_tokens(rollouts))))
        steps = P.step_metrics(steps, gen_metrics, timer, n_tokens, self.world, self.trainer, self.device)
        for i, m in enumerate(steps):
            self.sink.log_metrics(m, step=self.state.global_step + i + 1)
        self.state = P.record_update(self.state, steps, self.trainer.kl_ctrl.value)
        if P.should_evaluate(cfg, self.state.round):
            self.evaluate()
        self.state, verdict = decide(self.state, steps, cfg)
        self.save()
        return verdict

    def _update_share(self, scored):
        """This rank's rows for the update. Prompts were split over ranks before rollout, so
        each rank holds its own scored rows; with `trainer.balance_batch` they are gathered
        into the round's step-major table and split again by tokens (`stages.shard_for_update`)."""
        if self.world == 1 or not self.cfg.trainer.balance_batch:
            return scored
        table = stages.step_major(D.all_gather_object(scored), self.cfg.trainer.steps_per_round)
        return stages.shard_for_update(table, self.cfg, self.rank, self.world)

    # -- checkpoints -------------------------------------------------------------------------
    def save(self) -> Path:
        """Write the round checkpoint atomically (all ranks write their optimizer shards)."""
        final = ckpt.checkpoint_root(self.out) / ckpt.round_dir_name(self.state.round)
        ckpt.save(final, self.trainer, self.tokenizer, self.cfg, self.state)
        if self.rank == 0:
            ckpt.prune(self.out, self.cfg.trainer.max_ckpt_to_keep)
        D.barrier()
        if self.cfg.rollout.name == "vllm":  # the HF engines share the trainer's module
            self._policy_dir = str(final / "actor")
            if self._engine is not None:
                self._engine.update_weights(self._policy_dir)
        return final

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self.sink.close()


def _lap(t: float) -> float:
    return time.perf_counter() - t


def train(cfg: PPOConfig) -> dict:
    """Run PPO rounds until `trainer.total_rounds` or an early stop; returns the summary."""
    run = Run(cfg)
    try:
        if P.should_validate_first(cfg, run.state):
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
    out = P.summary(run.cfg, run.state)
    if verdict.reason:
        out["stop_reason"] = verdict.reason
    val_history = out.pop("val_history")
    out.update({"wall_s": time.perf_counter() - run.t0, "resumed_from": run.resumed_from, "world_size": run.world,
                "output_dir": str(run.out), "val_history": val_history})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", help="YAML or JSON config file (verl-style keys)")
    p.add_argument("--summary-json", help="also write the summary here")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.clip_ratio=0.3")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.cfg, args.overrides)
    except ConfigError as e:
        p.exit(2, f"error: {e}\n")
    summary = train(cfg)
    if args.summary_json and D.world()[0] == 0:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(summary, indent=2))
    if D.world()[0] == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "val_history"}, indent=2))
    D.shutdown()
    return 0


class _CallableModule(type(sys)):
    """Lets `rlhf.train(cfg)` call `train(cfg)` while `python -m rlhf.train` stays a module."""

    def __call__(self, cfg: PPOConfig) -> dict:
        return train(cfg)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
