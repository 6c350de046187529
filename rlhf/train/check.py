"""Check a launch without running it: config, data files, model directories, sizes.

    python -m rlhf.train.check [--cfg FILE] [key=value ...]    # the same arguments as rlhf.train
    python -m rlhf.train --dry-run [--cfg FILE] [key=value ...]
    pyflyte run workflows/ppo.py ppo_pipeline ...       # check first: python -m rlhf.train.check --cfg FILE

`check_launch(path, overrides)` runs in a few seconds, before DeepSpeed or Flyte are
imported: the config's values (each key of the file and each override on its own, so that
every wrong one is named), the batch sizes, the local dataset files (read and validated,
as the run reads them; remote URIs are left to the run), the model, critic and
reward-model directories, the position limit against the sequence lengths, and how often
a round resamples a small train set (`preflight` for a config already built). Every
mistake found ends the command in one report (exit status 2), each with its message
alone; the plan it prints says what the run would do, its rounds counted as the run
counts them (`trainer.total_epochs` over the train rows the run keeps).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass, field
from typing import Callable

from rlhf.config.load import from_dict, load_config, read_config_file
from rlhf.config.schema import ConfigError, PPOConfig
from rlhf.config.sizes import derive_sizes, resolve_epochs
from rlhf.data.checks import check_position_limit, resampling_message, user_sft_split
from rlhf.data.io import list_parquet_files, read_prompts, resolve_path
from rlhf.models.gguf import find_gguf, resolve_model_path
from rlhf.models.load import check_model_source, load_options, load_tokenizer
from rlhf.round import stages
from rlhf.round.stages import check_data_sources

log = logging.getLogger(__name__)


MAX_CHECK_BYTES = 256 << 20  # local datasets up to this size are read and validated by the check


class CheckFailed(ValueError):
    """A launch that cannot run: the message names each key, file or row and what to do
    (`problems`: one message per mistake)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


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
    paths, train_names, val_names = [*d.train_files, *d.val_files], ", ".join(d.train_files), ", ".join(d.val_files)
    if not all(_is_local(p) for p in paths):
        plan.lines.append(f"data: {train_names} / {val_names} (remote: read by the run, not here)")
        return -1
    if sum(_local_bytes(p, d.base_dir) for p in paths) > MAX_CHECK_BYTES:
        plan.lines.append(f"data: {train_names} / {val_names} (over {MAX_CHECK_BYTES >> 20} MiB: files found, "
                          "rows validated by the run)")
        return -1

    train = read_prompts(d.train_files, drop_invalid=d.drop_invalid, base_dir=d.base_dir)
    val = read_prompts(d.val_files, drop_invalid=d.drop_invalid, base_dir=d.base_dir)
    check_data_sources(train, val, train_names, val_names)
    plan.lines.append(f"data: {len(train)} train rows ({train_names}), {len(val)} val rows ({val_names})")
    if not cfg.model.path:
        sft = user_sft_split(train, d.synthetic.n_sft)
        plan.lines.append(f"warm-start: the tiny model on {len(sft)} labeled train rows (target '#### <answer>')")
    return len(train)


def _local_bytes(path: str, base_dir: str) -> int:
    """Total size of the parquet files behind a local dataset path (raises when there are none)."""
    fs, files = list_parquet_files(resolve_path(path, base_dir))
    return sum(int(fs.size(f) or 0) for f in files)


def _check_models(cfg: PPOConfig, plan: Plan, problems: list[Exception]) -> None:
    m = cfg.model
    for key, path in (("model.path", m.path), ("model.critic_path", m.critic_path),
                      ("reward.model_path", cfg.reward.model_path)):
        if path and _is_local(path):
            gguf = find_gguf(path)  # a GGUF file is converted to safetensors once, when the run starts
            if gguf is not None or _attempt(problems, check_model_source, path, allow_network=m.allow_network):
                plan.lines.append(f"{key}: {path}" + (" (GGUF, converted to safetensors once)" if gguf else ""))
    if not m.path:
        plan.lines.append(f"policy: tiny model built in code ({m.tiny.num_hidden_layers} layers, hidden "
                          f"{m.tiny.hidden_size}), SFT warm-start {'on' if m.sft.enable else 'off'}")


def _attempt(problems: list[Exception], fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, or None with its error added to `problems` when it finds a mistake."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, OSError) as e:  # ConfigError, DataValidationError, ModelLoadError, missing files
        problems.append(e)
        return None


def _failed(problems: list[Exception]) -> Exception:
    """The error of a check that found `problems`: a config mistake alone as its `ConfigError`,
    anything else as `CheckFailed` naming every one."""
    if len(problems) == 1 and isinstance(problems[0], (ConfigError, CheckFailed)):
        return problems[0]
    messages = [str(e) for e in problems]
    return CheckFailed(_report(messages), messages)


def preflight(cfg: PPOConfig) -> Plan:
    """Check `cfg`'s launch without running it; raises `CheckFailed` naming every mistake found
    (each with its fix)."""
    plan, problems = Plan(), []
    t = cfg.trainer
    world = t.n_gpus_per_node * t.nnodes
    sizes = _attempt(problems, derive_sizes, cfg, world)
    _check_models(cfg, plan, problems)
    _attempt(problems, check_position_limit, cfg)
    n_train = _attempt(problems, _check_data, cfg, plan)
    rounds = _attempt(problems, _rounds, cfg, n_train) if n_train is not None and not problems else None
    if problems:
        raise _failed(problems)
    plan.lines.append(f"rounds: {rounds} x {t.steps_per_round} steps of {sizes.prompts_per_step} prompts "
                      f"x {cfg.rollout.n} responses, on {world} rank(s), validation every {t.test_freq} round(s)")
    plan.lines.append(f"outputs: {t.output_dir}; trackers: {', '.join(t.logger)}")
    if n_train >= 0 and (message := resampling_message(n_train, cfg)):
        plan.warnings.append(message)
    return plan


def _rounds(cfg: PPOConfig, n_read: int) -> str:
    """The rounds the run will do: `trainer.total_rounds`, or with `trainer.total_epochs` the
    rounds `resolve_epochs` makes of the train rows the run keeps (the rows read, `n_read`, fitted
    to the policy's tokenizer as `rlhf.round.stages.fit_data` does), told with how they were
    counted; when the check did not read the rows (remote or large files), the run counts them."""
    epochs = cfg.trainer.total_epochs
    if epochs <= 0:
        return str(cfg.trainer.total_rounds)
    if n_read < 0:
        return f"{epochs} epoch(s) of the train rows (counted by the run once it has read them)"

    train = stages.prepare_data(cfg).train
    if cfg.data.filter_overlong_prompts:
        train = stages.fit_prompts(train, _tokenizer(cfg), cfg, "train")
    rounds = resolve_epochs(cfg, len(train)).trainer.total_rounds
    kept = f"{len(train)} of {n_read}" if len(train) != n_read else f"{n_read}"
    return f"{rounds} ({epochs} epoch(s) of {kept} train prompts)"


def _tokenizer(cfg: PPOConfig):
    """The policy's tokenizer, as the run will load it (the tiny model's is built in code)."""
    if not cfg.model.path:
        from rlhf.models.tokenizer import build_char_tokenizer  # loads transformers: only for the built-in model

        return build_char_tokenizer()

    return load_tokenizer(resolve_model_path(cfg.model.path, allow_network=cfg.model.allow_network),
                          **load_options(cfg.model))


def check_launch(path: str | None, overrides: list[str],
                 announce: Callable[[PPOConfig], None] | None = None) -> tuple[PPOConfig, Plan]:
    """The config of `path` and `overrides` and its checked launch; raises `CheckFailed` naming
    every mistake found, in the config (`config_mistakes`) and in the launch (`preflight`, run
    on the keys that are right so that its mistakes are found in the same pass). `announce`
    sees the config before the launch is checked (the defaults line explains a check's error)."""
    cfg, mistakes = load_checked(path, overrides)
    if cfg is None:
        raise CheckFailed(_report(mistakes), mistakes)
    if announce is not None:
        announce(cfg)
    try:
        plan = preflight(cfg)
    except (ConfigError, CheckFailed) as e:
        found = mistakes + getattr(e, "problems", [str(e)])
        raise CheckFailed(_report(found), found) from None
    if mistakes:
        raise CheckFailed(_report(mistakes), mistakes)
    return cfg, plan


def load_checked(path: str | None, overrides: list[str]) -> tuple[PPOConfig | None, list[str]]:
    """(config, mistakes): `load_config(path, overrides)` and no mistake, or every mistake in
    them and the config of the keys that are right (None when those clash with each other, or
    the file cannot be read). Each key of the file and each override is tried on its own over
    the defaults, and a key wrong on its own counts only if it is also wrong beside the right
    ones (its validity may depend on another key); what the right ones get wrong together is
    the last mistake."""
    try:
        return load_config(path, overrides), []
    except ConfigError as whole:
        first = str(whole)
    try:
        data = read_config_file(path) if path else {}
    except ConfigError as e:
        return None, [str(e)]
    items = [("file", leaf) for leaf in _leaves(data)] + [("override", text) for text in overrides]
    alone = [_mistake([item], path) for item in items]
    right = [item for item, wrong in zip(items, alone) if not wrong]
    mistakes = []
    for item, wrong in zip(items, alone):
        if wrong and _mistake(right + [item], path):
            mistakes.append(wrong)
        elif wrong:
            right.append(item)
    together = _mistake(right, path)
    mistakes += [together] if together else []
    cfg = None if together else from_dict(*_split(right))
    return cfg, mistakes or [first]


def _leaves(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """(key path, value) of every value of a nested mapping that is not itself a non-empty mapping."""
    out = []
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out += _leaves(v, prefix + (str(k),))
        else:
            out.append((prefix + (str(k),), v))
    return out


def _split(items: list) -> tuple[dict, list[str]]:
    """(the nested mapping of the file keys, the overrides) of a selection of items."""
    tree: dict = {}
    for kind, item in items:
        if kind == "file":
            parts, value = item
            node = tree
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = value
    return tree, [item for kind, item in items if kind == "override"]


def _mistake(items: list, path: str | None) -> str:
    """What is wrong with the config these items make, "" when nothing."""
    try:
        from_dict(*_split(items))
        return ""
    except ConfigError as e:
        from_file = any(kind == "file" for kind, _ in items) and len(items) == 1
        return f"{path}: {e}" if from_file else str(e)


def _report(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} mistakes in this launch:\n" + "\n".join(f"  - {p}" for p in problems)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.train.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", help="YAML or JSON config file (see docs/CONFIG.md)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides (before or after --cfg)")
    args = p.parse_intermixed_args(argv)
    try:
        _, plan = check_launch(args.cfg, args.overrides)
    except (ConfigError, CheckFailed) as e:
        p.exit(2, f"error: {e}\n")
    print(plan.text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
