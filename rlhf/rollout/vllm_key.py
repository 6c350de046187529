"""What a vLLM engine is built from, its weights and paths aside: the key by which a parked
engine is reused for the next policy (`rlhf.rollout.vllm.open_engine`), and the differences
between two keys, named for the warning when it is not."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from rlhf.config.schema import RolloutConfig

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                    "chat_template.jinja")
# tokenizer_config.json keys that define tokens (saving again adds load-time keys such as is_local)
_TOKENIZER_KEYS = ("added_tokens_decoder", "bos_token", "eos_token", "pad_token", "unk_token", "chat_template",
                   "tokenizer_class")
# config.json keys that a saved policy may change without changing the engine it needs
_CONFIG_NOT_ENGINE = ("_name_or_path", "transformers_version", "use_cache", "_attn_implementation",
                      "_attn_implementation_autoset", "output_attentions", "output_hidden_states", "return_dict")


def engine_key(model_dir: str, cfg: RolloutConfig, seed: int, dtype: str | None, max_model_len: int | None,
               trust_remote_code: bool) -> dict:
    """What an engine is built from, its weights and paths aside: the rollout settings, seed and
    dtype, the model's config (architecture), the tokenizer's files and tokens and the EOS ids
    of the generation config (as JSON values, so that two keys compare by value)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for k in _CONFIG_NOT_ENGINE + (("torch_dtype", "dtype") if dtype not in (None, "auto") else ()):
        config.pop(k, None)
    files = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        f = Path(model_dir) / name
        files.update(name.encode() + (f.read_bytes() if f.is_file() else b"-"))
    tok_cfg = Path(model_dir) / "tokenizer_config.json"
    tokens = json.loads(tok_cfg.read_text()) if tok_cfg.is_file() else {}
    files.update(json.dumps({k: tokens.get(k) for k in _TOKENIZER_KEYS}, sort_keys=True, default=str).encode())
    generation = Path(model_dir) / "generation_config.json"  # its EOS ids are stop tokens
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    return json.loads(json.dumps({"rollout": dataclasses.asdict(cfg), "seed": seed, "dtype": dtype,
                                  "max_model_len": max_model_len, "trust_remote_code": trust_remote_code,
                                  "model config": config, "tokenizer": files.hexdigest(), "generation eos": eos},
                                 default=str))


def key_differences(old: dict, new: dict) -> list[str]:
    """What differs between two `engine_key`s, named: `rollout.<key> (old -> new)` for the
    rollout settings and the model config's keys, the part's name for the rest."""
    out = []
    for part in sorted(old.keys() | new.keys()):
        a, b = old.get(part), new.get(part)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and part in ("rollout", "model config"):
            out += [f"{part}.{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in sorted(a.keys() | b.keys())
                    if a.get(k) != b.get(k)]
        elif part == "tokenizer":
            out.append("tokenizer files")
        else:
            out.append(f"{part} ({a!r} -> {b!r})")
    return out
