"""The starting (and reference) policy of a run: `model.path` resolved (a GGUF file is
converted once to safetensors, `rlhf.models.gguf`), or the tiny default model built and
SFT-warm-started in code (`rlhf.trainer.default_policy`), cached in the output directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlhf.config.schema import PPOConfig
from rlhf.round.stages import DataBundle
from rlhf.data.checks import user_sft_split
from rlhf.models.gguf import resolve_model_path


def prepare_policy(cfg: PPOConfig, out_dir: str | os.PathLike, data: DataBundle) -> str:
    """The starting (and reference) policy directory: `model.path` (a GGUF file, or a directory
    holding one, converted once to safetensors: `rlhf.models.gguf`), or the tiny default model
    built and SFT-warm-started in code (cached in `<out_dir>/base_model`)."""
    if cfg.model.path:
        if cfg.model.critic_path:  # converted here too, so the update's workers find it in the cache
            resolve_model_path(cfg.model.critic_path, allow_network=cfg.model.allow_network)
        return resolve_model_path(cfg.model.path, allow_network=cfg.model.allow_network)
    base = Path(out_dir) / "base_model"
    if (base / "config.json").is_file():
        return str(base)
    from rlhf.trainer.default_policy import build_default_policy  # loads transformers: only for the built-in policy

    # User data: the tiny model is warm-started on its labeled rows (target "#### <ground truth>").
    sft = data.sft if data.sft is not None else user_sft_split(data.train, cfg.data.synthetic.n_sft)
    return build_default_policy(cfg, str(base), sft)
