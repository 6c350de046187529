"""Round checkpoints, written atomically and found again on resume.

Layout: `<output_dir>/checkpoints/round_000005/` holding `actor/` and `critic/`
(safetensors + tokenizer, loadable by any HF tool; the only copy of the weights),
`engine/` (DeepSpeed's optimizer state and counters, without the module weights),
`config.yaml` and `state.json` (the `RoundState`). A checkpoint is written under a hidden
temporary name, sealed with `manifest.json` (every file's size and digest) and renamed
into place only when complete, so a crash mid-save never leaves a directory that reads as
valid. Before a checkpoint is used, every file is checked against the manifest
(`rlhf.checkpoint.verify`, whose names this module also gives). Weights holding
NaN or inf are never checkpointed (`NonFiniteStateError`). `rlhf.checkpoint.writer` writes
the files, in a background thread when the driver keeps training meanwhile.

`trainer.save_freq` picks the rounds checkpointed (`is_save_point`) and
`trainer.max_ckpt_to_keep` how many of them stay (`prune`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from rlhf.checkpoint.adapters import adapter_files
from rlhf.checkpoint.pieces import file_digest, hash_name
from rlhf.checkpoint.verify import (  # noqa: F401  (checking and finding checkpoints, named here too)
    MANIFEST_FILE, STATE_FILE, CorruptCheckpointError, checkpoint_root, corrupt, is_complete, latest_checkpoint,
    round_checkpoints, round_dir_name, verify, why_incomplete)
from rlhf.checkpoint.writer import SaveJob, TensorFile, capture_engine, keep_module_weights, run_file_jobs, run_inline
from rlhf.config.load import save_config
from rlhf.models.load import VALUE_CONFIG_FILE, VALUE_HEAD_FILE
from rlhf.models.lora import has_adapters, lora_scaling, merged_state_dict
from rlhf.round.state import RoundState
from rlhf.trainer import dist as D
from rlhf.trainer.engines import full_state_dict
from rlhf.trainer.faults import NonFiniteStateError, non_finite_tensors

log = logging.getLogger("rlhf.checkpoint")


def tmp_dir_for(root: Path, round_: int) -> Path:
    return root / f".tmp_{round_dir_name(round_)}"


def write_manifest(path: Path, digests: dict[str, str] | None = None) -> None:
    """Seal a fully written checkpoint directory: record every file's size and digest,
    atomically. `digests` holds those already computed while writing (relative path ->
    digest); every other file is read and hashed here."""
    algo, digests = hash_name(), digests or {}
    files = {}
    for f in sorted(path.rglob("*")):
        if not f.is_file() or f.name in (MANIFEST_FILE, f".{MANIFEST_FILE}.tmp"):
            continue
        rel = str(f.relative_to(path))
        files[rel] = {"size": f.stat().st_size, "digest": digests.get(rel) or file_digest(f, algo)}
    tmp = path / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps({"digest": algo, "files": files}, indent=1, sort_keys=True))
    os.replace(tmp, path / MANIFEST_FILE)


def commit(tmp: Path, final: Path) -> None:
    """Move a fully written temporary checkpoint into place (atomic rename on one filesystem)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def is_save_point(trainer_cfg, round_: int) -> bool:
    """Whether round `round_` (1-based) is one `trainer.save_freq` asks to keep: every
    `save_freq` rounds and the last; none with `save_freq` -1 (verl's meaning: no checkpoint)."""
    freq = trainer_cfg.save_freq
    return freq > 0 and (round_ >= trainer_cfg.total_rounds or round_ % freq == 0)


def should_save(trainer_cfg, round_: int, stopping: bool) -> bool:
    """The in-process driver checkpoints at save points and when the run stops early (never
    with `save_freq` -1)."""
    return trainer_cfg.save_freq > 0 and (stopping or is_save_point(trainer_cfg, round_))


def prune(output_dir: str | os.PathLike, keep: int, save_point: Callable[[int], bool] = lambda r: True) -> None:
    """`prune_dir` on the checkpoints of a run's output directory."""
    prune_dir(checkpoint_root(output_dir), keep, save_point)


def prune_dir(root: Path, keep: int, save_point: Callable[[int], bool] = lambda r: True) -> None:
    """Delete the round checkpoints in `root` beyond the newest `keep` save points (`keep` <= 0:
    keep all). The newest checkpoint always stays, save point or not: it is where the run
    resumes (the stateless driver hands the optimizer state to the next round through it)."""
    if keep <= 0 or not Path(root).is_dir():
        return
    found = round_checkpoints(Path(root))
    points = [p for r, p in found if save_point(r)]
    kept = set(points[-keep:]) | ({found[-1][1]} if found else set())
    for _, p in found:
        if p not in kept:
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------
# Writing and restoring a trainer's state
# ---------------------------------------------------------------------------------

ENGINE_DIR = "engine"  # DeepSpeed engine state (optimizer, counters; no weights), one sub-directory per model
ENGINE_TAG = "state"
CONFIG_FILE = "config.yaml"
WEIGHTS_FILE = "model.safetensors"


def save(final: Path, trainer, tokenizer, cfg, state, writer=None, extra: dict[str, Path] | None = None,
         after_seal: Callable[[], None] | None = None) -> Path:
    """Write a complete checkpoint at `final`, atomically. All ranks must call it.

    Every rank's DeepSpeed state goes into a hidden temporary directory, rank 0's also the
    safetensors models, the config, `state.json` and the directories in `extra` (name ->
    path, moved in); the manifest (sizes and digests) is written last and the directory
    renamed into place, then `after_seal` runs on rank 0. With a `CheckpointWriter`, the
    copy off the device and the writing run in its thread and this returns at once (an
    optimizer step waits for the copy; anything else that changes the weights or optimizer
    state in place calls `writer.wait_copied()` first); without one, it returns once every
    rank's part is written and the directory sealed.
    Raises `NonFiniteStateError` (on every rank, writing nothing) when a weight is NaN or inf."""
    rank, world = D.world()[:2]
    final = Path(final)
    tmp = final.parent / f".tmp_{final.name}"
    if writer is not None:
        writer.wait()  # the previous save is sealed (or its error raised) before this one starts
    files = _collect(tmp, trainer, tokenizer, cfg, state, extra or {}, final)
    device = next(trainer.actor.module.parameters()).device
    ready = None
    if device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    seal = (lambda digests: _seal(tmp, final, digests, after_seal)) if rank == 0 else None
    job = SaveJob(tmp=tmp, rank=rank, world=world, files=files, seal=seal, ready=ready, device=device)
    if writer is None:
        run_inline(job)
        D.barrier()  # sealed on rank 0 before any rank returns
    else:
        writer.submit(job)
    return final


def _collect(tmp: Path, trainer, tokenizer, cfg, state, extra: dict, final: Path) -> list:
    """This rank's files of a checkpoint in `tmp`: the small ones written, the state ones as
    `TensorFile`s referring to the live tensors."""
    models = {"actor": trainer.actor, "critic": trainer.critic}
    state_dicts = {k: full_state_dict(e) for k, e in models.items() if e is not None}  # collective under ZeRO-3
    refuse_non_finite(state_dicts, final)
    if D.world()[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    D.barrier()
    files = [f for name, e in models.items() if e is not None for f in _engine_files(e, tmp / ENGINE_DIR / name)]
    if D.world()[0] == 0:
        files += _write_small_files(tmp, trainer, tokenizer, cfg, state, state_dicts, extra)
    return files


def reserve(root: Path, trainer, tokenizer, cfg, state, writer) -> None:
    """Have `writer` allocate the host buffers that a save of `trainer` into `root` will copy
    into, in its thread (`CheckpointWriter.reserve`). All ranks must call it; it writes only
    a scratch directory, removed again."""
    scratch = Path(root) / ".tmp_reserve"
    files = _collect(scratch, trainer, tokenizer, cfg, state, {}, scratch)
    writer.reserve(files, scratch)
    D.barrier()
    if D.world()[0] == 0:
        shutil.rmtree(scratch, ignore_errors=True)


def _seal(tmp: Path, final: Path, digests: dict[str, str], after_seal) -> None:
    write_manifest(tmp, digests)
    commit(tmp, final)
    if after_seal is not None:
        after_seal()


def _engine_files(engine, save_dir: Path) -> list:
    """DeepSpeed's engine state of this rank, collected (not yet written) as `TensorFile`s."""
    engine.checkpoint_engine = capture_engine()
    engine.save_checkpoint(str(save_dir), tag=ENGINE_TAG, save_latest=False)
    return [TensorFile(path=p, kind="state", tree=sd) for p, sd in engine.checkpoint_engine.captured]


def _write_small_files(tmp: Path, trainer, tokenizer, cfg, state, state_dicts: dict, extra: dict[str, Path]
                       ) -> list:
    """Rank 0: configs, tokenizers, `state.json` and `extra` now; the weights as `TensorFile`s."""
    files = hf_model_files(trainer.actor.module, state_dicts["actor"], tokenizer, tmp / "actor")
    if "critic" in state_dicts:
        files += hf_model_files(trainer.critic.module, state_dicts["critic"], tokenizer, tmp / "critic")
    save_config(cfg, tmp / CONFIG_FILE)
    (tmp / STATE_FILE).write_text(state.to_json())
    for name, src in extra.items():
        if Path(src).is_dir():
            shutil.move(str(src), str(tmp / name))
    return files


def hf_model_files(module, state_dict: dict, tokenizer, path: Path, merged: bool = False) -> list:
    """A causal LM or a `ValueModel` as `save_pretrained` lays it out: its config and
    tokenizer written now, its (gathered) weights returned as `TensorFile`s to write.
    Tied weights are stored once, under the name `save_pretrained` keeps. A LoRA model is
    saved as its adapters (`rlhf.checkpoint.adapters`) unless `state_dict` is `merged` already."""
    if has_adapters(module) and not merged:
        return [TensorFile(f, "safetensors", t) for f, t in adapter_files(module, state_dict, tokenizer, path).items()]
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    if hasattr(module, "value_head"):  # ValueModel: the backbone's directory plus the head
        backbone = {k[len("backbone."):]: v for k, v in state_dict.items() if k.startswith("backbone.")}
        head = {k[len("value_head."):]: v for k, v in state_dict.items() if k.startswith("value_head.")}
        module.backbone.config.save_pretrained(str(path))
        (path / VALUE_CONFIG_FILE).write_text(json.dumps({"value_head": VALUE_HEAD_FILE,
                                                          "hidden_size": module.config.hidden_size}))
        return [TensorFile(path / WEIGHTS_FILE, "safetensors", _untied(module.backbone, backbone)),
                TensorFile(path / VALUE_HEAD_FILE, "safetensors", head)]
    module.config.save_pretrained(str(path))
    if getattr(module, "generation_config", None) is not None:
        module.generation_config.save_pretrained(str(path))
    return [TensorFile(path / WEIGHTS_FILE, "safetensors", _untied(module, state_dict))]


def _untied(module, state_dict: dict) -> dict:
    """`state_dict` without the tied copies (`lm_head.weight` when it is the embedding)."""
    tied = getattr(module, "all_tied_weights_keys", None) or {}
    return {k: v.contiguous() for k, v in state_dict.items() if not (k in tied and tied[k] in state_dict)}


def save_policy(path: Path, actor, tokenizer) -> Path:
    """The actor's current weights alone as `<path>/actor` (a model directory, replaced
    atomically; no optimizer state, no seal): what a rollout engine that reads files
    (vLLM) loads between checkpoints. All ranks must call it."""
    path = Path(path)
    sd = full_state_dict(actor)  # collective under ZeRO-3
    if D.world()[0] == 0:
        tmp = path.parent / f".tmp_{path.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        if has_adapters(actor.module):  # engines and servers load plain weights: W + (alpha / r) B A
            sd = merged_state_dict(sd, lora_scaling(actor.module))
        files: list[TensorFile] = hf_model_files(actor.module, sd, tokenizer, tmp / "actor", merged=True)
        run_file_jobs(files)
        commit(tmp, path)
    D.barrier()
    return path


def refuse_non_finite(state_dicts: dict, final: Path) -> None:
    """Raise `NonFiniteStateError` on every rank when any rank sees a NaN or inf weight."""
    bad = non_finite_tensors(state_dicts)
    if D.all_reduce_max(torch.tensor(1.0 if bad else 0.0)).item() == 0:
        return
    msg = (f"refusing to write checkpoint {final}: non-finite weights in {', '.join(bad) or 'another rank'}; "
           "the training state diverged (lower actor.lr or set actor.grad_clip); "
           "resume from the previous checkpoint")
    log.error("%s", msg)
    raise NonFiniteStateError(msg)


def read_state(path: Path):
    """The `RoundState` saved in checkpoint `path`."""
    return RoundState.from_json((Path(path) / STATE_FILE).read_text())


def restore(trainer, path: Path, state=None):
    """Load the DeepSpeed engine state (optimizer, counters) of checkpoint `path` into
    `trainer`, whose modules were built from that checkpoint's safetensors, then the round state (`state`, or the one saved there) into its KL controller
    and skip counter. Returns that state. Engine files are read weights-only (no pickled code)."""
    path = Path(path)
    state = state if state is not None else read_state(path)
    for name, engine in (("actor", trainer.actor), ("critic", trainer.critic)):
        if engine is None:
            continue
        device = next(engine.module.parameters()).device
        engine.checkpoint_engine = capture_engine(device)  # reads weights-only, onto the engine's device
        # The module already holds this checkpoint's weights (`build_trainer` read its safetensors).
        engine.load_checkpoint(str(path / ENGINE_DIR / name), tag=ENGINE_TAG, load_lr_scheduler_states=False,
                               custom_load_fn=keep_module_weights)
    apply_state(trainer, state)
    return state


def apply_state(trainer, state) -> None:
    """Carry the round state's KL coefficient and skipped-step count into the trainer."""
    trainer.kl_ctrl.value = state.kl_coef
    trainer.skipped_steps = state.skipped_steps
    trainer.global_step = state.global_step
