"""Round checkpoints, written atomically and found again on resume.

Layout: `<output_dir>/checkpoints/round_000003/` holding `actor/` and `critic/`
(safetensors + tokenizer, loadable by any HF tool), `engine/` (DeepSpeed optimizer
state), and `state.json` (the `RoundState`). A checkpoint is written under a hidden
temporary name, sealed with `manifest.json` (every file's size) and renamed into place
only when complete, so a crash mid-save never leaves a directory that reads as valid:
a missing manifest, a missing or truncated file is reported and an earlier checkpoint
used. Weights holding NaN or inf are never checkpointed (`NonFiniteStateError`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

_NAME = re.compile(r"^round_(\d{6})$")
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"  # written last: relative path -> size of every other file


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def round_dir_name(round_: int) -> str:
    return f"round_{round_:06d}"


def tmp_dir_for(root: Path, round_: int) -> Path:
    return root / f".tmp_{round_dir_name(round_)}"


def write_manifest(path: Path) -> None:
    """Seal a fully written checkpoint directory: record every file's size, atomically."""
    files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*"))
             if f.is_file() and f.name != MANIFEST_FILE}
    tmp = path / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    os.replace(tmp, path / MANIFEST_FILE)


def why_incomplete(path: Path) -> str:
    """"" for a complete checkpoint, else what is wrong with it."""
    try:
        files = json.loads((path / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (the save did not finish)"
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST_FILE} ({e})"
    for name in (STATE_FILE, "actor/config.json"):
        if name not in files:
            return f"{name} is not listed in {MANIFEST_FILE}"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} expected (truncated or overwritten)"
    return ""


def is_complete(path: Path) -> bool:
    return why_incomplete(path) == ""


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete round checkpoint; incomplete ones and left-over temporary
    directories of an interrupted save are skipped, each with a warning naming it."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    for p in sorted(root.glob(".tmp_*")):
        log.warning("ignoring half-written checkpoint %s (a save was interrupted before it was renamed)", p)
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))
    for _, path in reversed(found):
        reason = why_incomplete(path)
        if not reason:
            return path
        log.warning("checkpoint %s is not valid: %s; using an earlier one", path, reason)
    return None


def commit(tmp: Path, final: Path) -> None:
    """Move a fully written temporary checkpoint into place (atomic rename on one filesystem)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def prune(output_dir: str | os.PathLike, keep: int) -> None:
    root = checkpoint_root(output_dir)
    found = sorted(p for p in root.iterdir() if _NAME.match(p.name))
    for p in found[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------
# Writing and restoring a trainer's state
# ---------------------------------------------------------------------------------

ENGINE_DIR = "engine"  # DeepSpeed engine state (weights, optimizer), one sub-directory per model
ENGINE_TAG = "state"
CONFIG_FILE = "config.yaml"


def save(final: Path, trainer, tokenizer, cfg, state) -> Path:
    """Write a complete checkpoint at `final`, atomically: every rank writes its engine
    shards into a hidden temporary directory, rank 0 the safetensors models, the config,
    `state.json` and last the manifest, then renames it into place. All ranks must call it.
    Raises `NonFiniteStateError` (on every rank, writing nothing) when a weight is NaN or inf."""
    from rlhf.config import save_config
    from rlhf.trainer import dist as D
    from rlhf.trainer.engines import full_state_dict

    rank = D.world()[0]
    final = Path(final)
    tmp = final.parent / f".tmp_{final.name}"
    actor_sd = full_state_dict(trainer.actor)  # collective under ZeRO-3: every rank takes part
    critic_sd = full_state_dict(trainer.critic) if trainer.critic is not None else None
    refuse_non_finite({"actor": actor_sd, "critic": critic_sd}, final)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    D.barrier()
    trainer.actor.save_checkpoint(str(tmp / ENGINE_DIR / "actor"), tag=ENGINE_TAG)
    if trainer.critic is not None:
        trainer.critic.save_checkpoint(str(tmp / ENGINE_DIR / "critic"), tag=ENGINE_TAG)
    D.barrier()  # every rank's shards are on disk before rank 0 seals the directory
    if rank == 0:
        save_module(trainer.actor.module, actor_sd, tokenizer, tmp / "actor")
        if critic_sd is not None:
            save_module(trainer.critic.module, critic_sd, tokenizer, tmp / "critic")
        save_config(cfg, tmp / CONFIG_FILE)
        (tmp / STATE_FILE).write_text(state.to_json())
        write_manifest(tmp)
        commit(tmp, final)
    D.barrier()
    return final


def refuse_non_finite(state_dicts: dict, final: Path) -> None:
    """Raise `NonFiniteStateError` on every rank when any rank sees a NaN or inf weight."""
    import torch

    from rlhf.faults import NonFiniteStateError, non_finite_tensors
    from rlhf.trainer import dist as D

    bad = non_finite_tensors(state_dicts)
    if D.all_reduce_max(torch.tensor(1.0 if bad else 0.0)).item() == 0:
        return
    msg = (f"refusing to write checkpoint {final}: non-finite weights in {', '.join(bad) or 'another rank'}; "
           "the training state diverged (lower actor.lr or set actor.grad_clip); "
           "resume from the previous checkpoint")
    log.error("%s", msg)
    raise NonFiniteStateError(msg)


def save_module(module, state_dict, tokenizer, path: Path) -> None:
    """A causal LM as `save_pretrained` with the given (gathered) weights; a critic as a ValueModel dir."""
    from rlhf.models.load import save_model_atomic

    if hasattr(module, "save_pretrained") and not hasattr(module, "value_head"):
        module.save_pretrained(str(path), state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(str(path))
    else:
        save_model_atomic(module, tokenizer, str(path))


def read_state(path: Path):
    """The `RoundState` saved in checkpoint `path`."""
    from rlhf.state import RoundState

    return RoundState.from_json((Path(path) / STATE_FILE).read_text())


def restore(trainer, path: Path, state=None):
    """Load the DeepSpeed engine state (weights and optimizer) of checkpoint `path` into
    `trainer`, then the round state (`state`, or the one saved there) into its KL controller
    and skip counter. Returns that state. Engine files are read weights-only (no pickled code)."""
    from rlhf.trainer.safe_checkpoint import restrict_loading

    path = Path(path)
    state = state if state is not None else read_state(path)
    for engine in (trainer.actor, trainer.critic):
        if engine is not None:
            restrict_loading(engine)
    trainer.actor.load_checkpoint(str(path / ENGINE_DIR / "actor"), tag=ENGINE_TAG, load_module_strict=True,
                                  load_lr_scheduler_states=False)
    if trainer.critic is not None:
        trainer.critic.load_checkpoint(str(path / ENGINE_DIR / "critic"), tag=ENGINE_TAG,
                                       load_module_strict=True, load_lr_scheduler_states=False)
    apply_state(trainer, state)
    return state


def apply_state(trainer, state) -> None:
    """Carry the round state's KL coefficient and skipped-step count into the trainer."""
    trainer.kl_ctrl.value = state.kl_coef
    trainer.skipped_steps = state.skipped_steps
    trainer.global_step = state.global_step
