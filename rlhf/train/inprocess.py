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
from typing import Callable, NamedTuple, Optional

import pandas as pd

from rlhf.config.redact import redact
from rlhf.config.schema import PPOConfig
from rlhf.config.sizes import resolve_epochs
from rlhf.data.checks import check_fit
from rlhf.models.lora import has_adapters
from rlhf.checkpoint import rounds as ckpt
from rlhf.checkpoint import verify
from rlhf.checkpoint.writer import CheckpointWriter
from rlhf.round import offline, rules, stages
from rlhf.round.policy import prepare_policy
from rlhf.round.state import RoundState, Verdict, decide
from rlhf.tracking.profiling import StepProfiler
from rlhf.tracking.results import write_summary
from rlhf.tracking.sinks import NullSink, default_tracking_uri
import rlhf.train.setup as S
from rlhf.train.report import RoundClock, end_summary, print_round, publish
from rlhf.train.step import Hooks, RoundRows, StepResult, timer, update_step
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
        starts, failed = self._find_resume()
        # The newest checkpoint's digests are checked while the data and the policy are prepared.
        first = starts[0].path if starts else None
        verified = verify.start_verify(first, self.rank) if first is not None else None
        data = stages.prepare_data(cfg)
        if self.rank == 0:
            base_dir = prepare_policy(cfg, self.out, data)
        D.barrier()
        base_dir = D.broadcast_object(base_dir if self.rank == 0 else None)
        advice = verify.resume_advice(cfg.trainer.resume, self.out)
        self._build(base_dir, data, starts, fit=True, advice=advice, failed=failed, verified=verified)
        self.sink = S.run_sink(self.cfg, self.rank)

    @classmethod
    def start(cls, cfg: PPOConfig, base_dir: str, train: pd.DataFrame, val: pd.DataFrame,
              checkpoint: Optional[Path], state: RoundState, out_dir: str | Path, sink=None,
              resume: Optional[Path] = None) -> "Run":
        """A run from prompt tables already fitted to the tokenizer, the base (reference)
        policy, checkpoint `checkpoint` (None: the base policy, the state's KL coefficient)
        and `state`; or, when `resume` is given (a retried segment's own newer checkpoint),
        from `resume` with the state saved there, falling back to `checkpoint` if `resume`
        fails its check. Checkpoints go under `out_dir`, metrics to `sink` (rank 0's)."""
        run = cls.__new__(cls)
        run._setup_process(cfg, Path(out_dir))
        data = stages.DataBundle(train=train, val=val, sft=None)
        given = S.Start(Path(checkpoint) if checkpoint else None, state)
        starts = ([S.Start(Path(resume))] if resume else []) + [given]
        advice = verify.earlier_advice(state.checkpoints, str(checkpoint))
        run._build(base_dir, data, starts, fit=False, advice=advice)
        run.sink = sink if sink is not None and run.rank == 0 else NullSink()
        return run

    def _setup_process(self, cfg: PPOConfig, out: Path) -> None:
        self.cfg = cfg
        self.t0 = time.perf_counter()
        proc = S.start_process(cfg, out)
        self.device, self.rank, self.world, self.sizes, self.out = (proc.device, proc.rank, proc.world, proc.sizes,
                                                                     proc.out)
        self.writer = CheckpointWriter()  # checkpoints are written in its thread while rounds go on
        self._reserved = False  # whether the writer's host buffers are allocated
        self.timing: dict[str, float] = {}  # the last round's stage and checkpoint times, in seconds

    def _build(self, base_dir: str, data: stages.DataBundle, starts: list[S.Start], fit: bool, advice: str,
               failed: Optional[list[str]] = None, verified: Optional[Callable[[], None]] = None) -> None:
        """Tokenizer, trainer (from the first of `starts` whose checkpoint passes its check,
        `setup.load_first_valid`), engine, reward model."""
        cfg = self.cfg
        self.base_dir = base_dir
        self.tokenizer = S.load_tokenizer(cfg, base_dir)
        self.data = stages.fit_data(data, self.tokenizer, cfg) if fit else data
        self.cfg = cfg = resolve_epochs(cfg, len(self.data.train))  # trainer.total_epochs -> total_rounds
        check_fit(cfg, len(self.data.train), base_dir)
        self.start_timing: dict[str, float] = {}  # seconds: trainer build, wait for the digests, restore
        self.trainer, self.state, start = S.load_first_valid(cfg, self.sizes, base_dir, self.device, starts, advice,
                                                             failed, verified, self.start_timing)
        resume = start.path
        self.resumed_from = str(resume) if resume else ""
        if resume:
            log.info("resumed from %s at round %d (global step %d, kl_coef %.5g)", resume, self.state.round,
                     self.state.global_step, self.state.kl_coef)
            self._reserve()  # the optimizer state exists: the writer allocates its buffers while round 1 runs
        # The engine is built on first use (`engine`): offline training without validation never builds one.
        self._policy_dir, self._engine = (str(resume / "actor") if resume else base_dir), None
        if resume and has_adapters(self.trainer.actor.module):
            self.sync_engine()  # the checkpoint's actor/ holds adapters; vLLM loads them merged into the base
        self._engine_behind = False  # the trainer's weights moved on while no engine was built
        self.offline = offline.offline_table(cfg, self.tokenizer)  # the stored rollouts, or None (online)
        self.reward_model = stages.load_reward_model(cfg, self.device)
        self.profiler = StepProfiler(cfg.trainer.profile_steps, self.out, self.device, self.rank)

    def _find_resume(self) -> tuple[list[S.Start], list[str]]:
        """Where the run may start, in order, and the checkpoints already found broken (rank 0
        looks, then tells every rank): `trainer.resume`'s checkpoints, newest first; the base
        policy only when there is no checkpoint at all (none left after the broken ones stops
        the run: `setup.load_first_valid`)."""
        found = verify.resume_candidates(self.cfg.trainer.resume, self.out) if self.rank == 0 else None
        paths, failed = D.broadcast_object(([str(p) for p in found[0]], found[1]) if found else None)
        return [S.Start(Path(p)) for p in paths] or ([] if failed else [S.Start(None)]), failed

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
    def round(self) -> tuple[StepResult, Verdict]:
        """One whole round, as the in-process driver runs it: the update (`update_round`),
        the validation and early-stop decision (`end_round`), the checkpoint (`checkpoint`)."""
        result = self.update_round()
        verdict = self.end_round(result.steps)
        self.checkpoint(ckpt.should_save(self.cfg.trainer, self.state.round, verdict.stop))
        return result, verdict

    def update_round(self) -> StepResult:
        """One round up to its update: sample, rollout, score (`_generate`), then the update
        half (`step.update_step`): stored rollouts, the PPO steps, the engine given the new
        weights, the steps' metrics logged; the state moved on (round, global step, KL)."""
        hooks = Hooks(share=self._update_share, release=self._release, stalled=self.writer.take_stalled,
                      sync=self.sync_engine)
        rows = self._generate()  # moves the state's sampling position on
        result = update_step(self.cfg, self.trainer, self.tokenizer, self.state, rows, self, self.sink, self.profiler,
                             hooks)
        self.state, self.timing = result.state, dict(result.timing)
        return result

    def _release(self) -> None:
        if self._engine is not None:
            self._engine.release()  # vLLM's KV cache and weights make room for the update

    def _generate(self) -> RoundRows:
        """This rank's rows of the round: its share of the sampled prompts generated and
        scored, or (offline) the stored table's rows; with `timing_s/gen` and `timing_s/reward`."""
        cfg, timing = self.cfg, {}
        with timer(timing, "timing_s/gen"):
            prompts, self.state = stages.sample_prompts(self.data.train, self.state, cfg)
            prompts = stages.shard(prompts, cfg.trainer.steps_per_round, self.rank, self.world)
            seed = rules.rollout_seed(cfg, self.state.round, self.rank)
        if self.offline is not None:  # offline RLHF: the stored table stands in for generation
            with timer(timing, "timing_s/reward"):
                rollouts, scored = offline.offline_round(self.offline, cfg, self.state.round, self.rank, self.world,
                                                         self.reward_model)
            return RoundRows(rollouts, scored, timing)
        with timer(timing, "timing_s/gen"):
            rollouts = stages.rollout(self.engine, self.tokenizer, prompts, cfg, seed=seed)
        with timer(timing, "timing_s/reward"):
            scored = stages.score(rollouts, cfg, self.reward_model)
        return RoundRows(rollouts, scored, timing)

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
        """Validate the current policy: the score, recorded in the state and logged with the
        validation's seconds (`timing_s/testing`, of which `timing_s/testing_engine_build`
        building the engine, 0 once built), as the validation task logs them."""
        t = time.perf_counter()
        engine = self.engine
        built = _lap(t)
        self.state, metrics, samples = S.evaluate(engine, self.tokenizer, self.data.val, self.cfg,
                                                  self.reward_model, self.state)
        metrics.update({"timing_s/testing": _lap(t), "timing_s/testing_engine_build": built})
        if self.rank == 0:
            # the run's artifacts, where the validation task writes them (a segment's `out` holds its checkpoints)
            S.log_evaluation(self.sink, self.state.global_step, metrics, samples, self.cfg.trainer.output_dir)
        return stages.val_score(metrics)

    # -- checkpoints and weights ------------------------------------------------------------
    def checkpoint(self, save: bool, on_sealed: Callable[[Path], None] = lambda path: None) -> None:
        """The checkpoint step of a round, the same for the in-process driver and a segment:
        with `save` (a save point of the driver's policy), a checkpoint written in the
        background (`save`); otherwise, once the optimizer state exists (after the first update,
        or at the start from a checkpoint), the writer's host buffers allocated in its thread
        while the next rounds run, so that no save copies into fresh memory pages (an optimizer
        step after it would wait for them). Its time on the training thread goes to the sink as
        `timing_s/save_checkpoint`."""
        t = time.perf_counter()
        if save:
            self.save(on_sealed)
        elif not self._reserved:
            self._reserve()
        self.timing["timing_s/save_checkpoint"] = _lap(t)
        # `timing_s/checkpoint_wait` went out with the round's step metrics.
        self.sink.log_metrics({"timing_s/save_checkpoint": self.timing["timing_s/save_checkpoint"]},
                              step=self.state.global_step)

    def _reserve(self) -> None:
        """The writer's host buffers for the saves to come, allocated in its thread (`ckpt.reserve`)."""
        ckpt.reserve(ckpt.checkpoint_root(self.out), self.trainer, self.tokenizer, self.cfg, self.state, self.writer)
        self._reserved = True

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


def _lap(t: float) -> float:
    return time.perf_counter() - t


class Rounds(NamedTuple):
    """What `run_rounds` ran to: the verdict of the last decision, the last round's update."""

    verdict: Verdict
    last: Optional[StepResult]  # None when no round ran


def run_rounds(run: Run, until: int, decide_last: bool = True,
               after_round: Callable[[Run, StepResult], None] = lambda run, result: None) -> Rounds:
    """The round loop both the in-process driver and a colocated Flyte segment run: whole
    rounds until `until` rounds are done or an early stop, `after_round(run, result)` after
    each (the checkpoint policy of the driver; `result` the round's update). With
    `decide_last` False, the round that reaches `until` stops after its update: its
    validation and decision are the caller's (a segment's, between segments)."""
    verdict, last = Verdict(stop=bool(run.state.stop_reason), reason=run.state.stop_reason), None
    while run.state.round < until and not verdict.stop:
        last = run.update_round()
        if run.state.round < until or decide_last:
            verdict = run.end_round(last.steps)
        after_round(run, last)
    return Rounds(verdict, last)


def train(cfg: PPOConfig) -> dict:
    """Run PPO rounds until `trainer.total_rounds` or an early stop; returns the summary.
    A failure after tracking started ends the tracked run as FAILED."""
    run, status = None, "FAILED"
    try:
        run = Run(cfg)
        cfg = run.cfg  # with trainer.total_epochs resolved against the train set
        if rules.should_validate_first(cfg, run.state):
            run.evaluate()
        clock = RoundClock(run.state.round)

        def after_round(r: Run, result: StepResult) -> None:
            r.checkpoint(ckpt.should_save(r.cfg.trainer, r.state.round, bool(r.state.stop_reason)))
            if r.rank == 0:
                print_round(r.cfg, r.state, result.steps, time.perf_counter() - r.t0, clock)

        verdict = run_rounds(run, cfg.trainer.total_rounds, after_round=after_round).verdict
        run.flush()  # the last checkpoint is sealed before the run reports it
        # trainer.save_freq=-1 writes no checkpoint (as verl); the final policy is still the run's output
        final = ckpt.save_policy(run.out / "final_policy", run.trainer.actor, run.tokenizer) \
            if cfg.trainer.save_freq <= 0 else None
        summary = end_summary(cfg, run.state, verdict.reason, wall_s=time.perf_counter() - run.t0,
                              resumed_from=run.resumed_from, world_size=run.world,
                              output_dir=str(run.out.resolve()))
        if cfg.trainer.save_merged:  # a plain model directory for serving: LoRA adapters merged in
            summary["merged_policy"] = str(ckpt.save_policy(run.out / "merged_policy", run.trainer.actor,
                                                            run.tokenizer).resolve() / "actor")
        if run.rank == 0:
            _finish(run, summary, final)
        status = "FINISHED"
        return summary
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if run is not None:
            run.close(status, raise_errors=status == "FINISHED")


def _finish(run: Run, summary: dict, final: Path | None = None) -> None:
    """Rank 0 at the end: summary.json (strict JSON), summary metrics, config, curves, final
    policy (`final`'s, else the last checkpoint's)."""
    last = final or ckpt.latest_checkpoint(run.out, checksums=False)  # sealed a moment ago by this process
    summary["final_policy"] = policy = str((last / "actor").resolve()) if last is not None else run.base_dir
    summary["mlflow_run"] = _mlflow_run(run)
    path = write_summary(run.out / "summary.json", summary)
    run.sink.log_artifact(str(path))
    publish(run.sink, run.cfg, run.state, summary, policy, run.out)
    if last is not None:
        run.sink.log_artifact(str(last / "actor"), artifact_path="final_model")


def _mlflow_run(run: Run) -> str:
    """`<run id> at <tracking URI>` of the run's MLflow run, "" without one."""
    sinks = getattr(run.sink, "sinks", [run.sink])
    run_id = next((getattr(s, "run_id", "") for s in sinks if getattr(s, "run_id", "")), "")
    if not run_id:
        return ""
    t = run.cfg.trainer
    return f"{run_id} at {redact(default_tracking_uri(t.mlflow_tracking_uri, t.output_dir))}"
