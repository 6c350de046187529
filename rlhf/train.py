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
        from rlhf.models.load import load_tokenizer

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
        from rlhf.checkpoint_io import CheckpointWriter

        self.writer = CheckpointWriter()  # checkpoints are written in its thread while rounds go on
        self._reserved = False  # whether the writer's host buffers are allocated
        self.timing: dict[str, float] = {}  # the last round's stage and checkpoint times, in seconds
        resume = self._find_resume()
        self.resumed_from = str(resume) if resume else ""
        policy_dir = str(resume / "actor") if resume else self.base_dir
        self.tokenizer = load_tokenizer(self.base_dir, trust_remote_code=cfg.model.trust_remote_code)
        self.data = stages.fit_data(self.data, self.tokenizer, cfg)
        self.trainer = P.build_trainer(cfg, self.sizes, self.base_dir, self.device, resume)
        self.state = RoundState.initial(cfg)
        if resume:
            self.state = ckpt.restore(self.trainer, resume)
            log.info("resumed from %s at round %d (global step %d, kl_coef %.5g)", resume, self.state.round,
                     self.state.global_step, self.state.kl_coef)
        self.engine = self._make_engine(policy_dir)
        self.reward_model = stages.load_reward_model(cfg, self.device)
        self.sink = self._make_sink()
        from rlhf.profiling import StepProfiler

        self.profiler = StepProfiler(cfg.trainer.profile_steps, self.out, self.device, self.rank)

    # -- set-up helpers ------------------------------------------------------------------
    def _find_resume(self) -> Path | None:
        """The newest valid checkpoint (rank 0 reads and checks it, then tells every rank)."""
        if self.cfg.trainer.resume != "auto":
            return None
        found = ckpt.latest_checkpoint(self.out) if self.rank == 0 else None
        found = D.broadcast_object(str(found) if found else "")
        return Path(found) if found else None

    def _make_engine(self, policy_dir: str):
        from rlhf.rollout import make_engine

        model = self.trainer.actor.module if self.cfg.rollout.name in ("hf", "hf_fast") else None
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
        rollouts = stages.rollout(self.engine, self.tokenizer, prompts, cfg, seed=seed)
        timer["timing_s/gen"] += _lap(t)
        t = time.perf_counter()
        scored = stages.score(rollouts, cfg, self.reward_model)
        timer["timing_s/reward"] = _lap(t)
        t = time.perf_counter()
        local = self._update_share(scored)
        torch.manual_seed(P.update_seed(cfg, self.state.round, self.rank))
        with self.profiler.update(self.state.global_step + 1, cfg.trainer.steps_per_round, self.sink):
            steps = stages.update(self.trainer, local, self.tokenizer.pad_token_id, cfg)
        # Its first optimizer step waited for the copy of the last save's state, if still under way.
        timer["timing_s/checkpoint_wait"] = self.writer.take_stalled()
        timer["timing_s/update"] = _lap(t) - timer["timing_s/checkpoint_wait"]
        gen_metrics = D.mean_across_ranks(stages.rollout_metrics(rollouts, cfg))
        n_tokens = float(D.all_reduce_sum(torch.tensor(P.count_tokens(rollouts))))
        steps = P.step_metrics(steps, gen_metrics, timer, n_tokens, self.world, self.trainer, self.device)
        for i, m in enumerate(steps):
            self.sink.log_metrics(m, step=self.state.global_step + i + 1)
        self.state = P.record_update(self.state, steps, self.trainer.kl_ctrl.value)
        t = time.perf_counter()
        if P.should_evaluate(cfg, self.state.round):
            self.evaluate()
        timer["timing_s/testing"] = _lap(t)
        self.state, verdict = decide(self.state, steps, cfg)
        t = time.perf_counter()
        self._checkpoint(verdict.stop)
        timer["timing_s/save_checkpoint"] = _lap(t)
        self.timing = timer
        self.sink.log_metrics({k: timer[k] for k in ("timing_s/save_checkpoint", "timing_s/checkpoint_wait")},
                              step=self.state.global_step)
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
    def _checkpoint(self, stopping: bool) -> None:
        """The round's checkpoint at a save point; otherwise the new weights to a rollout
        engine that reads files, and (once, after the first update has made the optimizer
        state) the writer's host buffers allocated while the next rounds run."""
        if ckpt.should_save(self.cfg.trainer, self.state.round, stopping):
            self.save()
            return
        self._sync_rollout_weights(None)
        if not self._reserved:
            ckpt.reserve(ckpt.checkpoint_root(self.out), self.trainer, self.tokenizer, self.cfg, self.state,
                         self.writer)
            self._reserved = True

    def save(self) -> Path:
        """Start the round checkpoint: the state is copied off the device and written by the
        writer thread (all ranks write their optimizer shards), sealed, and the checkpoints
        beyond `trainer.max_ckpt_to_keep` pruned, while the next round runs (its first
        optimizer step waits for the copy)."""
        final = ckpt.checkpoint_root(self.out) / ckpt.round_dir_name(self.state.round)
        tc = self.cfg.trainer
        ckpt.save(final, self.trainer, self.tokenizer, self.cfg, self.state, writer=self.writer,
                  after_seal=lambda: ckpt.prune(self.out, tc.max_ckpt_to_keep, lambda r: ckpt.is_save_point(tc, r)))
        self._sync_rollout_weights(final)
        return final

    def _sync_rollout_weights(self, final: Path | None) -> None:
        """vLLM reads the new policy from files (the HF engines share the trainer's module):
        the checkpoint's actor once written, else a weights-only copy of this round."""
        if self.cfg.rollout.name != "vllm":
            return
        if final is not None:
            self.writer.wait()
            D.barrier()
        else:
            final = ckpt.save_policy(self.out / "rollout_policy", self.trainer.actor, self.tokenizer)
        self.engine.update_weights(str(final / "actor"))

    def flush(self) -> float:
        """Wait for the checkpoint being written; seconds waited."""
        waited = self.writer.wait()
        D.barrier()
        return waited

    def close(self, raise_errors: bool = True) -> None:
        """Wait for the checkpoint being written and release the engines. A failed write
        raises, unless `raise_errors` is false (an error already on its way wins; it is logged)."""
        try:
            self.writer.close()
        except RuntimeError:
            if raise_errors:
                raise
            log.exception("the last checkpoint was not written")
        finally:
            self.engine.close()
            self.sink.close()


def _lap(t: float) -> float:
    return time.perf_counter() - t


def train(cfg: PPOConfig) -> dict:
    """Run PPO rounds until `trainer.total_rounds` or an early stop; returns the summary."""
    run = Run(cfg)
    finished = False
    try:
        if P.should_validate_first(cfg, run.state):
            run.evaluate()
        verdict = Verdict(stop=bool(run.state.stop_reason), reason=run.state.stop_reason)
        while run.state.round < cfg.trainer.total_rounds and not verdict.stop:
            verdict = run.round()
            _progress(run)
        run.flush()  # the last checkpoint is sealed before the run reports it
        summary = _summary(run, verdict)
        if run.rank == 0:
            path = run.out / "summary.json"
            path.write_text(json.dumps(summary, indent=2))
            run.sink.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))},
                                 step=run.state.global_step)
            run.sink.log_artifact(str(path))
            last = ckpt.latest_checkpoint(run.out, checksums=False)  # sealed a moment ago by this process
            if last is not None:
                run.sink.log_artifact(str(last / "actor"), artifact_path="final_model")
        finished = True
        return summary
    finally:
        run.close(raise_errors=finished)


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
