"""The set-up every driver shares: the in-process driver (`rlhf.train.inprocess.Run`), a
colocated segment built on it (`rlhf.train.segment`) and the stateless stages
(`rlhf.train.stateless`) all get their process, trainer, rollout engine, tracking sink,
validation and checkpoints from here, so the same config builds the same objects either way.

- process: `pick_device` (the device; `trainer.num_threads` torch threads on CPU) and
  `start_process` (that, plus the process group, the seed, the size checks and rank 0's
  output directory);
- trainer: `build_trainer` (models from a checkpoint's safetensors or the base policy) and
  `load_trainer` (that, plus the checkpoint's optimizer state and round state, its files
  checked against their digests while the trainer is built, `rlhf.checkpoint.verify`);
  `load_first_valid` tries the places a run may start from in order and says which file
  failed, or stops naming them all;
- rollout engine: `make_engine` (on the trainer's module or a policy directory) and
  `policy_engine` (a saved policy with its own tokenizer; one inside a checkpoint checked
  against the checkpoint's digests while the engine is built);
- tracking: `run_sink` (a driver that owns its run) and `open_tracking` / `tracking_sink` /
  `keep_pending` (stages that share one MLflow run, resumed by id);
- validation: `evaluate` and `log_evaluation`;
- checkpoints: `save_checkpoint`.

The order of a checkpoint save, the same for every driver (`save_checkpoint`):

1. the previous save of the process is sealed (or its error raised) first;
2. every rank's DeepSpeed state is copied off the device and written into a hidden
   temporary directory; rank 0 adds the safetensors models, the config, `state.json` and
   the extra directories (profiler traces), then the manifest, last;
3. the directory is renamed into place (sealed);
4. rank 0 prunes the checkpoints beyond `trainer.max_ckpt_to_keep` of the save points
   (`trainer.save_freq`), keeping the newest;
5. rank 0 runs the driver's `on_sealed(path)` (a segment's upload, the removal of the
   stateless update's trace directory).

Where a save falls in a round is each driver's: the in-process driver saves after the
round's validation and early-stop decision (at a save point, which an early stop is), so
its checkpoint holds them; the stateless update saves every round right after the update,
since its validation reads the policy from that checkpoint and runs in another task; a
segment saves after the decision inside the segment and after the last update at its end.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import pandas as pd
import torch

from rlhf.config.schema import PPOConfig, flatten
from rlhf.config.sizes import Sizes, derive_sizes
from rlhf.models import lora
from rlhf.models.load import (ValueModel, frozen_reference, is_adapter_dir, load_causal_lm, load_options,
                              load_tokenizer as _load, save_model_atomic)
from rlhf.checkpoint import rounds as ckpt
from rlhf.round import evaluate as validation
from rlhf.round import stages
from rlhf.round.state import RoundState, record_val
from rlhf.checkpoint.verify import next_hint, none_valid, policy_checkpoint, start_verify
from rlhf.trainer import dist as D
from rlhf.checkpoint.adapters import restore_adapters, start_base_digest
from rlhf.models.gguf import resolve_model_path
from rlhf import rollout as rollout_engines
from rlhf.tracking.artifacts import log_generations
from rlhf.tracking.buffer import BufferedMLflowSink
from rlhf.tracking.make import make_sink
from rlhf.tracking.sinks import MultiSink, NullSink
from rlhf.trainer.ppo import PPOTrainer

log = logging.getLogger("rlhf.checkpoint")

# -- process ------------------------------------------------------------------------------


def pick_device(cfg: PPOConfig) -> torch.device:
    """The configured device; on CPU, torch runs `trainer.num_threads` threads."""
    device = D.pick_device(cfg.trainer.device)
    if device.type == "cpu" and cfg.trainer.num_threads > 0:
        torch.set_num_threads(cfg.trainer.num_threads)
    return device


@dataclass
class Process:
    device: torch.device
    rank: int
    world: int
    sizes: Sizes  # the batch sizes per rank, derived from the config and the world size
    out: Path  # rank 0's output directory: every rank writes its shards there


def start_process(cfg: PPOConfig, out_dir: str | Path) -> Process:
    """The device, the process group (one rank without torchrun), the global seed, the size
    checks for this world size and rank 0's output directory (created)."""
    device = pick_device(cfg)
    rank, world = D.init_distributed(device)
    torch.manual_seed(cfg.trainer.seed)
    stages.check_sizes(cfg, world)
    sizes = derive_sizes(cfg, world)
    out = Path(D.broadcast_object(str(out_dir)))
    out.mkdir(parents=True, exist_ok=True)
    return Process(device=device, rank=rank, world=world, sizes=sizes, out=out)


# -- trainer ------------------------------------------------------------------------------


def load_tokenizer(cfg: PPOConfig, model_dir: str):
    return _load(model_dir, **load_options(cfg.model))


def build_trainer(cfg: PPOConfig, sizes: Sizes, base_dir: str, device: torch.device,
                  resume: Optional[Path] = None):
    """A `PPOTrainer`: actor and critic from checkpoint `resume` (its safetensors models) or,
    without one, from the base policy; the frozen reference is always the base policy.
    The optimizer state is not loaded here (`load_trainer` does that)."""
    m = cfg.model
    opts = load_options(m)
    actor_lora, critic_lora = lora.actor_spec(cfg), lora.critic_spec(cfg)
    actor = load_causal_lm(str(resume / "actor") if resume and not actor_lora.enabled else base_dir,
                           dtype=m.dtype, **opts)
    if actor_lora.enabled:  # the base weights with adapters (the checkpoint's, on resume)
        actor = with_adapters(actor, actor_lora, base_dir, resume / "actor" if resume else None)
    critic = None
    if cfg.algorithm.adv_estimator == "gae":
        if resume and not critic_lora.enabled:
            critic = ValueModel.from_pretrained(str(resume / "critic"), dtype=m.dtype, **opts)
        else:
            critic = ValueModel.from_causal_lm_dir(critic_source(cfg, base_dir), dtype=m.dtype, **opts)
        if critic_lora.enabled:
            critic = with_adapters(critic, critic_lora, critic_source(cfg, base_dir),
                                   resume / "critic" if resume else None)
    # The reference is the base policy: with LoRA, the actor's own module with its adapters off.
    ref = lora.BaseView(actor) if actor_lora.enabled else frozen_reference(base_dir, dtype=m.dtype, **opts)
    return PPOTrainer(cfg, sizes, actor, critic, ref, device)


def with_adapters(model, spec: lora.LoraSpec, base_dir: str, saved: Optional[Path]):
    """`model` (the base weights from `base_dir`) with `spec`'s adapters added, and those of
    checkpoint directory `saved` (and its value head) copied in when given."""
    lora.add_adapters(getattr(model, "backbone", model), spec, base_path=str(Path(base_dir).resolve()))
    if D.world()[0] == 0:
        start_base_digest(base_dir)  # rank 0's checkpoints record it: hashed while the run starts
    if saved is not None:
        restore_adapters(model, saved, base_dir)
    return model


def critic_source(cfg: PPOConfig, base_dir: str) -> str:
    """The critic's starting backbone: `model.critic_path` (a GGUF file converted through the
    cache) or the base policy."""
    if not cfg.model.critic_path:
        return base_dir

    return resolve_model_path(cfg.model.critic_path, allow_network=cfg.model.allow_network)


@dataclass(frozen=True)
class Start:
    """A place a trainer may start from: checkpoint `path` (None: the base policy) with `state`
    (None: the state saved in the checkpoint, or the initial one)."""

    path: Optional[Path]
    state: Optional[RoundState] = None


def load_trainer(cfg: PPOConfig, sizes: Sizes, base_dir: str, device: torch.device, resume: Optional[Path],
                 state: Optional[RoundState], timing: Optional[dict[str, float]] = None,
                 verified: Optional[Callable[[], None]] = None):
    """(trainer, state) at the start of a round: the trainer built from checkpoint `resume`
    with its optimizer state restored, or from the base policy, fresh. The state is `state`,
    else the one saved in `resume`, else the initial one; it is applied to the trainer (KL
    coefficient, skip counter). The checkpoint's files are checked against their digests while
    the trainer is built (`verified`, when the caller started that check earlier with
    `start_verify`), before anything of it is used: a missing or changed file raises
    `CorruptCheckpointError` naming it. `timing` gets `timing_s/build_trainer`,
    `timing_s/verify_checkpoint` (the wait) and `timing_s/restore`."""
    timing = {} if timing is None else timing
    if resume is not None and verified is None:
        verified = start_verify(resume, D.world()[0])
    t = time.perf_counter()
    try:
        trainer = build_trainer(cfg, sizes, base_dir, device, resume)
    except Exception:
        if verified is not None:
            verified()  # a changed file explains a failed build better than its traceback
        raise
    timing["timing_s/build_trainer"] = time.perf_counter() - t
    t = time.perf_counter()
    if verified is not None:
        try:
            verified()
        except ckpt.CorruptCheckpointError:
            del trainer  # before the next start is built: its device memory goes first
            _free_memory()
            raise
    timing["timing_s/verify_checkpoint"] = time.perf_counter() - t
    t = time.perf_counter()
    if resume:
        state = ckpt.restore(trainer, resume, state)
    else:
        state = state or RoundState.initial(cfg)
        ckpt.apply_state(trainer, state)
    timing["timing_s/restore"] = time.perf_counter() - t
    return trainer, state


def load_first_valid(cfg: PPOConfig, sizes: Sizes, base_dir: str, device: torch.device, starts: list[Start],
                     advice: str, failed: Optional[list[str]] = None,
                     verified: Optional[Callable[[], None]] = None, timing: Optional[dict[str, float]] = None):
    """(trainer, state, start) from the first of `starts` whose checkpoint passes its check
    (`load_trainer`; `verified` is the first one's check, when already started). A failed one
    is logged naming the file and the next one tried; when none is left, raises
    `CorruptCheckpointError` listing every failure (`failed` holds those found before) and
    `advice`, what to do. A start without a checkpoint (the base policy) never fails."""
    failed = list(failed or [])
    for i, start in enumerate(starts):
        try:
            trainer, state = load_trainer(cfg, sizes, base_dir, device, start.path, start.state, timing,
                                          verified if i == 0 else None)
            return trainer, state, start
        except ckpt.CorruptCheckpointError as e:
            failed.append(getattr(e, "what", "") or str(e))
            rest = [s.path or "the base policy" for s in starts[i + 1:]]
            log.warning("checkpoint %s is not valid; %s", failed[-1], next_hint(rest))
    raise none_valid(failed, advice)


def _free_memory() -> None:
    """Collect what a dropped trainer held (its engines hold reference cycles), device memory too."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -- rollout engine -----------------------------------------------------------------------


def make_engine(cfg: PPOConfig, policy_dir: str, tokenizer, device: torch.device, model=None):
    """The `rollout.name` engine for the policy in `policy_dir`; the HF engines generate with
    `model` (the trainer's actor module) when given."""
    return rollout_engines.make_engine(cfg.rollout.name, policy_dir, tokenizer, cfg.rollout, model=model,
                                       seed=cfg.trainer.seed, device=str(device), dtype=cfg.model.dtype,
                                       **load_options(cfg.model))


def policy_engine(cfg: PPOConfig, model_dir: str, device: torch.device):
    """(engine, tokenizer) for the policy saved in `model_dir`, with that directory's tokenizer.
    A policy inside a round checkpoint (`<checkpoint>/actor`) has its files checked against the
    checkpoint's digests while the engine is built, and is refused (`CorruptCheckpointError`
    naming the file) before it generates anything. LoRA adapters (a LoRA checkpoint's actor/)
    are merged into their base first for vLLM, which loads a plain model directory; the HF
    engines merge them as they load."""
    inside = policy_checkpoint(model_dir)
    verified = start_verify(inside[0], D.world()[0], part=inside[1]) if inside else None
    try:
        tokenizer = load_tokenizer(cfg, model_dir)
        engine = make_engine(cfg, _plain_model_dir(cfg, model_dir, tokenizer), tokenizer, device)
    except Exception:
        if verified is not None:
            verified()  # a changed file explains a failed load better than its traceback
        raise
    if verified is not None:
        try:
            verified()
        except ckpt.CorruptCheckpointError:
            engine.close()
            raise
    return engine, tokenizer


def _plain_model_dir(cfg: PPOConfig, model_dir: str, tokenizer) -> str:
    """`model_dir`, or for vLLM and a LoRA adapter directory, its adapters merged into their
    base and saved as a plain model directory."""
    if cfg.rollout.name != "vllm" or not is_adapter_dir(model_dir):
        return model_dir

    merged = load_causal_lm(model_dir, dtype=cfg.model.dtype, **load_options(cfg.model))
    return save_model_atomic(merged, tokenizer, str(Path(tempfile.mkdtemp(prefix="merged_policy_")) / "m"))


# -- tracking -----------------------------------------------------------------------------


def _sink_names(cfg: PPOConfig, mlflow: bool = True) -> list[str]:
    """The configured loggers but the console (the round line is the console's)."""
    return [n for n in cfg.trainer.logger if n != "console" and (mlflow or n != "mlflow")]


def run_sink(cfg: PPOConfig, rank: int):
    """The sinks of a driver that owns its tracked run (rank 0; the others log nothing),
    with the flattened config logged as parameters."""
    if rank != 0:
        return NullSink()
    sink = make_sink(_sink_names(cfg), cfg, run_name=cfg.trainer.experiment_name)
    sink.log_params(flatten(cfg))
    return sink


def open_tracking(cfg: PPOConfig, run_name: Optional[str] = None, tags: Optional[dict] = None) -> str:
    """Create the run's MLflow run (params logged, `tags` set) when `trainer.logger` lists
    mlflow; returns its id, or "" when MLflow is not used."""
    if "mlflow" not in cfg.trainer.logger:
        return ""

    sink = make_sink(["mlflow"], cfg, run_name=run_name, tags=tags)
    return sink.run_id


def tracking_sink(cfg: PPOConfig, run_id: str = "", state: Optional[RoundState] = None):
    """The configured sinks, with MLflow resuming run `run_id` (not closed by the stages) and
    wandb the run `state.wandb_id`; MLflow records an earlier task left in `state` (its server
    was down) are sent first. No console sink, since `decide` prints the round's line."""
    names = _sink_names(cfg, mlflow=bool(run_id))
    if not names:
        return NullSink()
    sink = make_sink(names, cfg, run_id=run_id or None, wandb_id=(state.wandb_id if state else "") or None)
    buffered = _buffered(sink)
    if buffered is not None and state is not None:
        buffered.import_pending(state.tracking_pending)
    return sink


def keep_pending(sink, state: RoundState) -> RoundState:
    """`state` carrying the MLflow records `sink` could not send yet (else none), so that they
    leave the task with its output instead of staying in its pod's buffer directory."""
    buffered = _buffered(sink)
    return replace(state, tracking_pending=buffered.export_pending() if buffered is not None else [])


def _buffered(sink):
    for s in sink.sinks if isinstance(sink, MultiSink) else [sink]:
        if isinstance(s, BufferedMLflowSink):
            return s
    return None


# -- validation ---------------------------------------------------------------------------


def evaluate(engine, tokenizer, val: pd.DataFrame, cfg: PPOConfig, reward_model, state: RoundState
             ) -> tuple[RoundState, dict[str, float], list[dict]]:
    """Validation of the engine's policy on `val` (`rlhf.round.evaluate`): the state with the
    score recorded (`record_val`), the metrics and a few sample generations."""
    samples: list[dict] = []
    metrics = validation.evaluate(engine, tokenizer, val, cfg, reward_model, samples=samples)
    return record_val(state, stages.val_score(metrics), cfg.early_stop.min_delta), metrics, samples


def log_evaluation(sink, step: int, metrics: dict[str, float], samples: list[dict], out_dir: str | Path) -> None:
    """A validation's metrics at `step`, and its sample generations as an artifact (under `out_dir`)."""
    sink.log_metrics(metrics, step=step)
    log_generations(sink, step, samples, out_dir)


# -- checkpoints --------------------------------------------------------------------------


def save_checkpoint(root: Path, trainer, tokenizer, cfg: PPOConfig, state: RoundState, writer=None,
                    extra: Optional[dict[str, Path]] = None,
                    on_sealed: Callable[[Path], None] = lambda path: None) -> Path:
    """Checkpoint `root/round_NNNNNN` of `state.round`, in the order of the module docstring:
    written (by `writer`'s thread when given, else before this returns), sealed, the older
    ones under `root` pruned, then `on_sealed(path)` (rank 0). All ranks call it."""
    final = root / ckpt.round_dir_name(state.round)
    tc = cfg.trainer

    def after_seal() -> None:
        ckpt.prune_dir(root, tc.max_ckpt_to_keep, lambda r: ckpt.is_save_point(tc, r))
        on_sealed(final)

    return ckpt.save(final, trainer, tokenizer, cfg, state, writer=writer, extra=extra, after_seal=after_seal)
