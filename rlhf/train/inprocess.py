"""The in-process driver: every round's stages in one process (or one per rank under
torchrun), the trainer, the rollout engine and the tables held in memory across rounds.

`Run` is one driver process's set-up and its round (`Run.round`: update, validation,
decision, checkpoint); `run_rounds` the round loop it shares with a colocated segment
(`rlhf.train.segment`); `train(cfg)` a whole run, returning the summary (also written to
`<output_dir>/summary.json`). The set-up and the checkpoint save are `rlhf.train.setup`'s,
the rules of a round (seeds, validation schedule, per-step metrics) `rlhf.round.rules`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

import pandas as pd
import torch

from rlhf.config.schema import ConfigError, PPOConfig
from rlhf.config.sizes import resolve_epochs
from rlhf.round import checkpoint as ckpt
from rlhf.round import offline, rules, stages
from rlhf.round.policy import prepare_policy
from rlhf.round.state import RoundState, Verdict, decide
import rlhf.train.setup as S
from rlhf.trainer import dist as D
from rlhf.trainer.engines import named_weights

log = logging.getLogger("rlhf.train")


class Run:
    """Everything one driver process holds across rounds: the trainer, the rollout engine
    (handed the updated weights in memory), the tables, the state. `Run(cfg)` is the
    in-process driver's start (data, policy and resume from `trainer.output_dir`);
    `Run.start(...)` starts from given tables, policy, checkpoint and state, as a colocated
    Flyte segment does (`rlhf.train.segment`). Both go through `run_rounds`."""

    def __init__(self, cfg: PPOConfig):
        self._setup_process(cfg, Path(cfg.trainer.output_dir))
        data = stages.prepare_data(cfg)
        if self.rank == 0:
            base_dir = prepare_policy(cfg, self.out, data)
        D.barrier()
        base_dir = D.broadcast_object(base_dir if self.rank == 0 else None)
        resume = self._find_resume()
        self._build(base_dir, data, resume, state=None, fit=True)
        self.sink = S.run_sink(self.cfg, self.rank)

    @classmethod
    def start(cls, cfg: PPOConfig, base_dir: str, train: pd.DataFrame, val: pd.DataFrame,
              checkpoint: Optional[Path], state: RoundState, out_dir: str | Path, sink=None) -> "Run":
        """A run from prompt tables already fitted to the tokenizer, the base (reference)
        policy, checkpoint `checkpoint` (None: the base policy, the state's KL coefficient)
        and `state`; checkpoints go under `out_dir`, metrics to `sink` (rank 0's)."""
        run = cls.__new__(cls)
        run._setup_process(cfg, Path(out_dir))
        data = stages.DataBundle(train=train, val=val, sft=None)
        run._build(base_dir, data, Path(checkpoint) if checkpoint else None, state=state, fit=False)
        from rlhf.tracking.sinks import NullSink

        run.sink = sink if sink is not None and run.rank == 0 else NullSink()
        return run

    def _setup_process(self, cfg: PPOConfig, out: Path) -> None:
        self.cfg = cfg
        self.t0 = time.perf_counter()
        proc = S.start_process(cfg, out)
        self.device, self.rank, self.world, self.sizes, self.out = (proc.device, proc.rank, proc.world, proc.sizes,
                                                                     proc.out)
        from rlhf.round.checkpoint_io import CheckpointWriter

        self.writer = CheckpointWriter()  # checkpoints are written in its thread while rounds go on
        self._reserved = False  # whether the writer's host buffers are allocated
        self.timing: dict[str, float] = {}  # the last round's stage and checkpoint times, in seconds

    def _build(self, base_dir: str, data: stages.DataBundle, resume: Optional[Path], state: Optional[RoundState],
               fit: bool) -> None:
        """Tokenizer, trainer (from `resume` or the base policy), engine, reward model; the
        state is `state`, else the one saved in `resume`, else the initial one."""
        cfg = self.cfg
        self.base_dir = base_dir
        self.resumed_from = str(resume) if resume else ""
        self.tokenizer = S.load_tokenizer(cfg, base_dir)
        self.data = stages.fit_data(data, self.tokenizer, cfg) if fit else data
        self.cfg = cfg = resolve_epochs(cfg, len(self.data.train))  # trainer.total_epochs -> total_rounds
        from rlhf.data.checks import check_fit

        check_fit(cfg, len(self.data.train), base_dir)
        self.trainer, self.state = S.load_trainer(cfg, self.sizes, base_dir, self.device, resume, state)
        if resume:
            log.info("resumed from %s at round %d (global step %d, kl_coef %.5g)", resume, self.state.round,
                     self.state.global_step, self.state.kl_coef)
        # The engine is built on first use (`engine`): offline training without validation never builds one.
        self._policy_dir, self._engine = (str(resume / "actor") if resume else base_dir), None
        self._engine_behind = False  # the trainer's weights moved on while no engine was built
        self.offline = offline.offline_table(cfg, self.tokenizer)  # the stored rollouts, or None (online)
        self.reward_model = stages.load_reward_model(cfg, self.device)
        self.last_step: dict[str, float] = {}  # the last PPO step's full metrics (for the round line)
        from rlhf.tracking.profiling import StepProfiler

        self.profiler = StepProfiler(cfg.trainer.profile_steps, self.out, self.device, self.rank)
        self.last_rollouts: Optional[pd.DataFrame] = None  # this rank's tables of the latest round
        self.last_scored: Optional[pd.DataFrame] = None
        self.last_steps: list[dict[str, float]] = []

    def _find_resume(self) -> Path | None:
        """`trainer.resume`'s checkpoint (rank 0 reads and checks it, then tells every rank)."""
        found = resume_point(self.cfg.trainer.resume, self.out) if self.rank == 0 else None
        found = D.broadcast_object(str(found) if found else "")
        return Path(found) if found else None

    @property
    def engine(self):
        """The rollout engine, built when first asked for: offline training without
        validation never builds one. The HF engines generate with the trainer's actor."""
        if self._engine is None:
            model = self.trainer.actor.module if self.cfg.rollout.name in ("hf", "hf_fast") else None
            self._engine = S.make_engine(self.cfg, self._policy_dir, self.tokenizer, self.device, model=model)
            if self._engine_behind:  # built from files older than the trainer's weights
                self.sync_engine()
        return self._engine

    # -- one round -------------------------------------------------------------------------
    def round(self) -> Verdict:
        """One whole round, as the in-process driver runs it: the update (`update_round`),
        the validation and early-stop decision (`end_round`), the checkpoint (`checkpoint`)."""
        verdict = self.end_round(self.update_round())
        self.checkpoint(verdict.stop)
        return verdict

    def update_round(self) -> list[dict[str, float]]:
        """One round up to its update: sample, rollout, score, the PPO steps; returns the
        steps' metrics (logged) with the state moved on (round, global step, KL coefficient)."""
        cfg, timer = self.cfg, {}
        rollouts, scored = self._generate(timer)
        rules.store_rollouts(cfg, scored, self.state.round + 1, self.rank)
        t = time.perf_counter()
        local = self._update_share(scored)
        torch.manual_seed(rules.update_seed(cfg, self.state.round, self.rank))
        if self._engine is not None:
            self._engine.release()  # vLLM's KV cache and weights make room for the update
        with self.profiler.update(self.state.global_step + 1, cfg.trainer.steps_per_round, self.sink):
            steps = stages.update(self.trainer, local, self.tokenizer.pad_token_id, cfg)
        # Its first optimizer step waited for the copy of the last save's state, if still under way.
        timer["timing_s/checkpoint_wait"] = self.writer.take_stalled()
        timer["timing_s/update"] = _lap(t) - timer["timing_s/checkpoint_wait"]
        t = time.perf_counter()
        self.sync_engine()
        timer["timing_s/update_weights"] = _lap(t)
        gen_metrics = D.mean_across_ranks(stages.rollout_metrics(rollouts, cfg))
        n_tokens = float(D.all_reduce_sum(torch.tensor(rules.count_tokens(rollouts))))
        steps = rules.step_metrics(steps, gen_metrics, timer, n_tokens, self.world, self.trainer, self.device)
        for i, m in enumerate(steps):
            self.sink.log_metrics(m, step=self.state.global_step + i + 1)
        self.state = rules.record_update(self.state, steps, self.trainer.kl_ctrl.value)
        self.last_rollouts, self.last_scored, self.last_steps = rollouts, scored, steps
        self.last_step = steps[-1] if steps else {}
        self.timing = timer
        return steps

    def _generate(self, timer: dict[str, float]) -> tuple[pd.DataFrame, pd.DataFrame]:
        """This rank's (rollouts, scored) of the round: its share of the sampled prompts
        generated and scored, or (offline) the stored table's rows; the times go to `timer`."""
        cfg = self.cfg
        t = time.perf_counter()
        prompts, self.state = stages.sample_prompts(self.data.train, self.state, cfg)
        prompts = stages.shard(prompts, cfg.trainer.steps_per_round, self.rank, self.world)
        seed = rules.rollout_seed(cfg, self.state.round, self.rank)
        timer["timing_s/gen"] = _lap(t)
        t = time.perf_counter()
        if self.offline is not None:  # offline RLHF: the stored table stands in for generation
            rollouts, scored = offline.offline_round(self.offline, cfg, self.state.round, self.rank, self.world,
                                                     self.reward_model)
            timer["timing_s/reward"] = _lap(t)
            return rollouts, scored
        rollouts = stages.rollout(self.engine, self.tokenizer, prompts, cfg, seed=seed)
        timer["timing_s/gen"] += _lap(t)
        t = time.perf_counter()
        scored = stages.score(rollouts, cfg, self.reward_model)
        timer["timing_s/reward"] = _lap(t)
        return rollouts, scored

    def _update_share(self, scored):
        """This rank's rows for the update. Prompts were split over ranks before rollout, so
        each rank holds its own scored rows; with `trainer.balance_batch` they are gathered
        into the round's step-major table and split again by tokens (`stages.shard_for_update`)."""
        if self.world == 1 or not self.cfg.trainer.balance_batch:
            return scored
        table = stages.step_major(D.all_gather_object(scored), self.cfg.trainer.steps_per_round)
        return stages.shard_for_update(table, self.cfg, self.rank, self.world)

    def end_round(self, steps: list[dict[str, float]]) -> Verdict:
        """The round's validation (every `test_freq` rounds and after the last) and the
        early-stop decision."""
        t = time.perf_counter()
        if rules.should_evaluate(self.cfg, self.state.round):
            self.evaluate()
        self.timing["timing_s/testing"] = _lap(t)
        self.state, verdict = decide(self.state, steps, self.cfg)
        return verdict

    def evaluate(self) -> float:
        """Validate the current policy: the score, recorded in the state and logged."""
        self.state, metrics, samples = S.evaluate(self.engine, self.tokenizer, self.data.val, self.cfg,
                                                  self.reward_model, self.state)
        if self.rank == 0:
            S.log_evaluation(self.sink, self.state.global_step, metrics, samples, self.out)
        return stages.val_score(metrics)

    # -- checkpoints and weights ------------------------------------------------------------
    def checkpoint(self, stopping: bool) -> None:
        """The in-process driver's checkpoint policy: a checkpoint at a save point (every
        `trainer.save_freq` rounds, the last round, an early stop), written in the background;
        otherwise (once, after the first update has made the optimizer state) the writer's host
        buffers allocated while the next rounds run. The times go to the sink."""
        t = time.perf_counter()
        if ckpt.should_save(self.cfg.trainer, self.state.round, stopping):
            self.save()
        elif not self._reserved:
            ckpt.reserve(ckpt.checkpoint_root(self.out), self.trainer, self.tokenizer, self.cfg, self.state,
                         self.writer)
            self._reserved = True
        self.timing["timing_s/save_checkpoint"] = _lap(t)
        self.sink.log_metrics({k: self.timing.get(k, 0.0) for k in ("timing_s/save_checkpoint",
                                                                    "timing_s/checkpoint_wait")},
                              step=self.state.global_step)

    def save(self, on_sealed: Callable[[Path], None] = lambda path: None) -> Path:
        """Start the round checkpoint (`setup.save_checkpoint`, under `<out>/checkpoints`):
        the state is copied off the device and written by the writer thread (all ranks write
        their optimizer shards), sealed, the older checkpoints pruned and `on_sealed(path)`
        called (rank 0, writer thread: a segment's upload), while the next round runs (its
        first optimizer step waits for the copy)."""
        final = S.save_checkpoint(ckpt.checkpoint_root(self.out), self.trainer, self.tokenizer, self.cfg,
                                  self.state, writer=self.writer, on_sealed=on_sealed)
        self._reserved = True  # the save allocated the writer's host buffers
        return final

    def sync_engine(self) -> None:
        """Hand the updated policy to the rollout engine before anything generates again. The HF
        engines share the trainer's module; vLLM is given the trainer's weights in memory when
        its workers live in this process, else the weights go through files (every round: the
        next rollout or validation must see this round's update)."""
        if self.cfg.rollout.name != "vllm":
            return
        self._engine_behind = self._engine is None
        if self._engine is None:
            return
        if self._engine.loads_from_memory:
            self._engine.load_weights(named_weights(self.trainer.actor))
            return
        policy = ckpt.save_policy(self.out / "rollout_policy", self.trainer.actor, self.tokenizer)
        self._policy_dir = str(policy / "actor")
        self._engine.update_weights(self._policy_dir)

    def flush(self) -> float:
        """Wait for the checkpoint being written; seconds waited."""
        waited = self.writer.wait()
        D.barrier()
        return waited

    def close(self, status: str = "FINISHED", raise_errors: bool = True, close_sink: bool = True) -> None:
        """Wait for the checkpoint being written, release the engine and end the tracked run
        with `status`. A failed write raises, unless `raise_errors` is false (an error already
        on its way wins; the write's is logged)."""
        try:
            self.writer.close()
        except RuntimeError:
            if raise_errors:
                raise
            log.exception("the last checkpoint was not written")
        finally:
            if self._engine is not None:
                self._engine.close()
            if close_sink:
                self.sink.close(status)


def resume_point(resume: str, output_dir: Path) -> Optional[Path]:
    """The checkpoint `trainer.resume` starts from: the newest complete one in the output
    directory ("auto"; every file checked against its digest), none ("disable"), or the
    named checkpoint directory."""
    if resume == "auto":
        return ckpt.latest_checkpoint(output_dir)
    if resume == "disable":
        return None
    path = Path(resume)
    reason = "it does not exist" if not path.is_dir() else ckpt.why_incomplete(path)
    if reason:
        raise ConfigError(f"trainer.resume={resume!r} is not a checkpoint to start from: {reason}; give a round "
                          "checkpoint directory (<output_dir>/checkpoints/round_NNNNNN), auto or disable")
    return path


def _lap(t: float) -> float:
    return time.perf_counter() - t


def run_rounds(run: Run, until: int, decide_last: bool = True,
               after_round: Callable[[Run], None] = lambda run: None) -> Verdict:
    """The round loop both the in-process driver and a colocated Flyte segment run: whole
    rounds until `until` rounds are done or an early stop, `after_round` after each (the
    checkpoint policy of the driver). With `decide_last` False, the round that reaches
    `until` stops after its update: its validation and decision are the caller's (a
    segment's, between segments)."""
    verdict = Verdict(stop=bool(run.state.stop_reason), reason=run.state.stop_reason)
    while run.state.round < until and not verdict.stop:
        steps = run.update_round()
        if run.state.round < until or decide_last:
            verdict = run.end_round(steps)
        after_round(run)
    return verdict


def train(cfg: PPOConfig) -> dict:
    """Run PPO rounds until `trainer.total_rounds` or an early stop; returns the summary.
    A failure after tracking started ends the tracked run as FAILED."""
    run, status = None, "FAILED"
    try:
        run = Run(cfg)
        cfg = run.cfg  # with trainer.total_epochs resolved against the train set
        if rules.should_validate_first(cfg, run.state):
            run.evaluate()
        t_loop, rounds_before = time.perf_counter(), run.state.round

        def after_round(r: Run) -> None:
            r.checkpoint(stopping=bool(r.state.stop_reason))
            _progress(r, t_loop, r.state.round - rounds_before)

        verdict = run_rounds(run, cfg.trainer.total_rounds, after_round=after_round)
        run.flush()  # the last checkpoint is sealed before the run reports it
        summary = _summary(run, verdict)
        if run.rank == 0:
            _finish(run, summary)
        status = "FINISHED"
        return summary
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if run is not None:
            run.close(status, raise_errors=status == "FINISHED")


def _finish(run: Run, summary: dict) -> None:
    """Rank 0 at the end: summary.json (strict JSON), summary metrics, config, curves, final policy."""
    from rlhf.tracking.artifacts import log_results
    from rlhf.tracking.results import write_summary

    last = ckpt.latest_checkpoint(run.out, checksums=False)  # sealed a moment ago by this process
    summary["final_policy"] = policy = str((last / "actor").resolve()) if last is not None else run.base_dir
    summary["mlflow_run"] = _mlflow_run(run)
    path = write_summary(run.out / "summary.json", summary)
    run.sink.log_metrics({k: v for k, v in summary.items() if isinstance(v, (int, float))},
                         step=run.state.global_step)
    run.sink.log_artifact(str(path))
    log_results(run.sink, run.cfg, run.state, summary.get("stop_reason", ""), policy, run.out)
    if last is not None:
        run.sink.log_artifact(str(last / "actor"), artifact_path="final_model")
    run.sink.set_tags({"stop_reason": summary.get("stop_reason", "")})


def _mlflow_run(run: Run) -> str:
    """`<run id> at <tracking URI>` of the run's MLflow run, "" without one."""
    from rlhf.config.redact import redact
    from rlhf.tracking.sinks import default_tracking_uri

    sinks = getattr(run.sink, "sinks", [run.sink])
    run_id = next((getattr(s, "run_id", "") for s in sinks if getattr(s, "run_id", "")), "")
    if not run_id:
        return ""
    t = run.cfg.trainer
    return f"{run_id} at {redact(default_tracking_uri(t.mlflow_tracking_uri, t.output_dir))}"


def _progress(run: Run, t_loop: float, rounds_here: int) -> None:
    """The round line (rank 0): k/N, step, headline metrics, time per step, elapsed, ETA."""
    if run.rank != 0:
        return
    from rlhf.tracking.progress import print_line, round_line

    s = run.state
    last = {**(s.step_history[-1] if s.step_history else {}), **run.last_step}
    per_round = (time.perf_counter() - t_loop) / max(1, rounds_here)
    print_line(round_line(s.round, run.cfg.trainer.total_rounds, s.global_step, last, s.last_val,
                          time.perf_counter() - run.t0, per_round))


def _summary(run: Run, verdict: Verdict) -> dict:
    out = rules.summary(run.cfg, run.state)
    if verdict.reason:
        out["stop_reason"] = verdict.reason
    val_history = out.pop("val_history")
    out.update({"wall_s": time.perf_counter() - run.t0, "resumed_from": run.resumed_from, "world_size": run.world,
                "output_dir": str(run.out.resolve()), "val_history": val_history})
    return out
