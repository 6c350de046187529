"""Check a launch without running it: config, data files, model directories, sizes.

    python -m rlhf.train.check [--cfg FILE] [key=value ...]    # the same arguments as rlhf.train
    python -m rlhf.train --dry-run [--cfg FILE] [key=value ...]
    pyflyte run workflows/ppo.py ppo_pipeline ...       # check first: python -m rlhf.train.check --cfg FILE

`preflight(cfg)` runs in a few seconds, before DeepSpeed, transformers or Flyte are
imported: the config's values and batch sizes, the local dataset files (read and
validated, as the run reads them; remote URIs are left to the run), the model, critic
and reward-model directories, the position limit against the sequence lengths, and
how often a round resamples a small train set. A mistake ends the command with its
message alone (exit status 2); the plan it prints says what the run would do.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field

from rlhf.config.load import load_config
from rlhf.config.schema import ConfigError, PPOConfig
from rlhf.config.sizes import derive_sizes

log = logging.getLogger(__name__)


MAX_CHECK_BYTES = 256 << 20  # local datasets up to this size are read and validated by the check


class CheckFailed(ValueError):
    """A launch that cannot run: the message names the key, file or row and what to do."""


@dataclass
class Plan:
    """What a checked launch would do, as lines to print, and the warnings found."""

    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def text(self) -> str:
        head = ["launch checked: nothing was run"] + [f"  {line}" for line in self.lines]
        return "\n".join(head + [f"  warning: {w}" for w in self.warnings])


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _check_data(cfg: PPOConfig, plan: Plan) -> int:
    """Reads and validates local dataset files; returns the train row count (-1: not read)."""
    d = cfg.data
    if not d.train_files:
        plan.lines.append(f"data: synthetic arithmetic ({d.synthetic.n_train} train, {d.synthetic.n_val} val, "
                          f"{d.synthetic.n_sft} SFT problems)")
        return d.synthetic.n_train
    if not d.val_files:
        raise CheckFailed("data.train_files is set but data.val_files is empty; give a validation parquet")
    if not (_is_local(d.train_files) and _is_local(d.val_files)):
        plan.lines.append(f"data: {d.train_files} / {d.val_files} (remote: read by the run, not here)")
        return -1
    if _local_bytes(d.train_files, d.base_dir) + _local_bytes(d.val_files, d.base_dir) > MAX_CHECK_BYTES:
        plan.lines.append(f"data: {d.train_files} / {d.val_files} (over {MAX_CHECK_BYTES >> 20} MiB: files found, "
                          "rows validated by the run)")
        return -1
    from rlhf.data.io import read_prompts
    from rlhf.round.stages import check_data_sources

    train = read_prompts(d.train_files, drop_invalid=d.drop_invalid, base_dir=d.base_dir)
    val = read_prompts(d.val_files, drop_invalid=d.drop_invalid, base_dir=d.base_dir)
    check_data_sources(train, val, d.train_files, d.val_files)
    plan.lines.append(f"data: {len(train)} train rows ({d.train_files}), {len(val)} val rows ({d.val_files})")
    if not cfg.model.path:
        from rlhf.data.checks import user_sft_split

        sft = user_sft_split(train, d.synthetic.n_sft)
        plan.lines.append(f"warm-start: the tiny model on {len(sft)} labeled train rows (target '#### <answer>')")
    return len(train)


def _local_bytes(path: str, base_dir: str) -> int:
    """Total size of the parquet files behind a local dataset path (raises when there are none)."""
    from rlhf.data.io import list_parquet_files, resolve_path

    fs, files = list_parquet_files(resolve_path(path, base_dir))
    return sum(int(fs.size(f) or 0) for f in files)


def _check_models(cfg: PPOConfig, plan: Plan) -> None:
    from rlhf.models.gguf import find_gguf
    from rlhf.models.load import check_model_source

    m = cfg.model
    for key, path in (("model.path", m.path), ("model.critic_path", m.critic_path),
                      ("reward.model_path", cfg.reward.model_path)):
        if path and _is_local(path):
            gguf = find_gguf(path)  # a GGUF file is converted to safetensors once, when the run starts
            if gguf is None:
                check_model_source(path, allow_network=m.allow_network)
            plan.lines.append(f"{key}: {path}" + (" (GGUF, converted to safetensors once)" if gguf else ""))
    if not m.path:
        plan.lines.append(f"policy: tiny model built in code ({m.tiny.num_hidden_layers} layers, hidden "
                          f"{m.tiny.hidden_size}), SFT warm-start {'on' if m.sft.enable else 'off'}")


def preflight(cfg: PPOConfig) -> Plan:
    """Check `cfg`'s launch without running it; raises `CheckFailed` (or `ConfigError`) with the fix."""
    from rlhf.data.checks import check_position_limit, resampling_message

    plan = Plan()
    t = cfg.trainer
    world = t.n_gpus_per_node * t.nnodes
    try:
        sizes = derive_sizes(cfg, world)
        _check_models(cfg, plan)
        check_position_limit(cfg)
        n_train = _check_data(cfg, plan)
    except ConfigError:
        raise
    except (ValueError, OSError) as e:  # DataValidationError, ModelLoadError, missing files
        raise CheckFailed(str(e)) from None
    plan.lines.append(f"rounds: {t.total_rounds} x {t.steps_per_round} steps of {sizes.prompts_per_step} prompts "
                      f"x {cfg.rollout.n} responses, on {world} rank(s), validation every {t.test_freq} round(s)")
    plan.lines.append(f"outputs: {t.output_dir}; trackers: {', '.join(t.logger)}")
    if n_train >= 0 and (message := resampling_message(n_train, cfg)):
        plan.warnings.append(message)
    return plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.train.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", help="YAML or JSON config file (see docs/CONFIG.md)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = p.parse_args(argv)
    try:
        plan = preflight(load_config(args.cfg, args.overrides))
    except (ConfigError, CheckFailed) as e:
        p.exit(2, f"error: {e}\n")
    print(plan.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
