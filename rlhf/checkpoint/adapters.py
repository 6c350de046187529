"""Checkpoints of LoRA models: the adapters (and the critic's value head), never the base.

With `model.lora_rank` > 0 a round checkpoint's `actor/` is a peft adapter directory:
`adapter_config.json`, `adapter_model.safetensors` (what `peft.PeftModel.from_pretrained`
loads onto the base model), the model's `config.json` and tokenizer, and `base_model.json`,
the pointer to the base weights: their directory and the digest of each of their files.
`critic/` is the same with `value_head.safetensors` beside it when `critic.lora_rank` > 0.
DeepSpeed's state holds the optimizer state of the trainable parameters only (the adapters
and the value head), so a checkpoint is a small fraction of a full one.

A resume rebuilds each model from the base (`model.path`, whose files must still have the
digests recorded) with the saved adapters copied in; a changed base is refused, since
adapters trained on other weights would silently mean something else. `save_merged` writes
a checkpoint's adapters merged into their (checked) base as a plain model directory.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from rlhf.checkpoint.pieces import file_digest, hash_name
from rlhf.models import lora
from rlhf.models.load import (VALUE_CONFIG_FILE, VALUE_HEAD_FILE, load_causal_lm, load_tokenizer,
                              merge_saved_adapters, save_model_atomic)

BASE_FILE = "base_model.json"
# What to do about adapters of another base, when a run starts from their checkpoint.
RESUME_FIX = ("point model.path (critic: model.critic_path) at the base they were trained on, or start without "
              "this checkpoint (trainer.resume=disable)")
# (dir, files' names, sizes and mtimes) -> the digests, being computed or done: each base is hashed once per process
_DIGESTS: dict[tuple, Future] = {}
_LOCK = threading.Lock()


def base_digest(base_dir: str) -> dict[str, str]:
    """The digest of every weight and config file of the base model directory `base_dir`."""
    return start_base_digest(base_dir).result()


def start_base_digest(base_dir: str) -> Future:
    """Start hashing the base model's files in a background thread (a 7B base is 15 GB: the
    first checkpoint should not wait for it); the future's result is `base_digest`'s."""
    d = Path(base_dir)
    names = sorted(n for n in os.listdir(d) if n.endswith((".safetensors", ".json")) and (d / n).is_file())
    key = (str(d.resolve()), tuple((n, (d / n).stat().st_size, (d / n).stat().st_mtime_ns) for n in names))
    with _LOCK:
        if key not in _DIGESTS:
            pool = ThreadPoolExecutor(1, thread_name_prefix="base-digest")
            _DIGESTS[key] = pool.submit(_digests, d, names)
            pool.shutdown(wait=False)  # its thread ends after this one job
        return _DIGESTS[key]


def _digests(d: Path, names: list[str]) -> dict[str, str]:
    algo = hash_name()
    return {n: f"{algo}:{file_digest(d / n, algo)}" for n in names}


def adapter_files(module, state_dict: dict, tokenizer, path: Path) -> dict[Path, dict]:
    """A LoRA model's checkpoint directory at `path`: its small files written now, the adapter
    (and value-head) tensors returned as {safetensors file: tensors} to write."""
    root = lora.lora_root(module)
    base = root.peft_config[lora.ADAPTER_NAME].base_model_name_or_path or ""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    root.config.save_pretrained(str(path))
    (path / lora.ADAPTER_CONFIG).write_text(lora.adapter_config_json(root, base))
    (path / BASE_FILE).write_text(json.dumps({"path": base, "files": base_digest(base)}, indent=1, sort_keys=True))
    prefix = "backbone." if root is not module else ""
    files = {path / lora.ADAPTER_WEIGHTS: lora.adapter_state_dict(state_dict, prefix)}
    if hasattr(module, "value_head"):
        (path / VALUE_CONFIG_FILE).write_text(json.dumps({"value_head": VALUE_HEAD_FILE,
                                                          "hidden_size": module.config.hidden_size}))
        files[path / VALUE_HEAD_FILE] = {k[len("value_head."):]: v for k, v in state_dict.items()
                                         if k.startswith("value_head.")}
    return files


def check_base(adapter_dir: Path, base_dir: str, fix: str = RESUME_FIX) -> None:
    """Raise `LoraSetupError` unless the base files recorded in `adapter_dir` are the ones in
    `base_dir`; its message ends with `fix`, what to do about it."""
    try:
        saved = json.loads((Path(adapter_dir) / BASE_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise lora.LoraSetupError(f"{adapter_dir} has no readable {BASE_FILE} ({e}): it does not say which base "
                                  "weights its adapters belong to") from e
    now = base_digest(base_dir)
    changed = sorted(n for n in set(saved) | set(now) if saved.get(n) != now.get(n))
    if changed:
        raise lora.LoraSetupError(
            f"the adapters in {adapter_dir} were trained on other base weights than {base_dir} "
            f"({', '.join(changed[:3])} differ): {fix}")


def restore_adapters(module, adapter_dir: Path, base_dir: str) -> None:
    """Copy the adapters (and the critic's value head) saved in `adapter_dir` into `module`,
    whose adapters were just added to the base in `base_dir`."""
    from safetensors.torch import load_file

    check_base(adapter_dir, base_dir)
    root = lora.lora_root(module)
    lora.load_adapter_state_dict(root, load_file(str(Path(adapter_dir) / lora.ADAPTER_WEIGHTS)),
                                 str(Path(adapter_dir) / lora.ADAPTER_WEIGHTS))
    if hasattr(module, "value_head"):
        module.value_head.load_state_dict(load_file(str(Path(adapter_dir) / VALUE_HEAD_FILE)))


def save_merged(adapter_dir: str | Path, base_dir: str, out_dir: str, dtype: str = "float32",
                fix: str = RESUME_FIX, **load_kwargs) -> str:
    """The LoRA adapters saved in `adapter_dir` (a LoRA checkpoint's `actor/`) merged into the
    base model in `base_dir`, `W + (lora_alpha / r) B A`, written atomically to `out_dir` as a
    plain model directory (no adapter files) with the adapter directory's tokenizer; returns
    `out_dir`. The base is checked first to be the one they were trained on (`check_base`,
    whose error ends with `fix`). `load_kwargs`: `rlhf.models.load.load_options`."""
    check_base(Path(adapter_dir), base_dir, fix)
    model = merge_saved_adapters(load_causal_lm(base_dir, dtype, **load_kwargs), adapter_dir)
    return save_model_atomic(model, load_tokenizer(str(adapter_dir), **load_kwargs), out_dir)
