"""`python -m rlhf.train`: the in-process driver's command line.

    python -m rlhf.train [--cfg FILE] [key=value ...] [--summary-json PATH]
    torchrun --nproc_per_node=2 -m rlhf.train trainer.n_gpus_per_node=2 ...

The config is checked before anything loads (`rlhf.train.check.preflight`; `--dry-run`
prints the plan and exits); a mistake in it, or one found once the data or model is
loaded, ends the command with one line and exit status 2. At the end rank 0 prints the
summary table (and writes `--summary-json`).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from rlhf.config.schema import ConfigError
from rlhf.config.verl_defaults import defaults_line
from rlhf.train.inprocess import train
from rlhf.trainer import dist as D
from rlhf.checkpoint.rounds import CorruptCheckpointError
from rlhf.data.io import DataValidationError
from rlhf.models.load import ModelLoadError
from rlhf.tracking.progress import quiet_progress_bars
from rlhf.tracking.results import summary_rows, summary_table, write_summary


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlhf.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", help="YAML or JSON config file (verl-style keys; see docs/CONFIG.md)")
    p.add_argument("--summary-json", help="also write the summary here")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config, data files and model directory, print the plan, and exit")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. actor.clip_ratio=0.3 (before or "
                   "after --cfg)")
    return p


def main(argv: list[str] | None = None) -> int:
    # rlhf.train.check also runs as `python -m rlhf.train.check`: the package (which imports this
    # module) must not have loaded it before runpy does
    from rlhf.train.check import CheckFailed, check_launch

    p = _parser()
    args = p.parse_intermixed_args(argv)  # overrides may stand before and after --cfg
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg, plan = check_launch(args.cfg, args.overrides, announce=_announce_defaults)
    except (ConfigError, CheckFailed) as e:
        p.exit(2, f"error: {e}\n")
    if args.dry_run:
        print(plan.text())
        return 0

    quiet_progress_bars()
    try:
        summary = train(cfg)
    except _user_errors() as e:  # found only once the data or model is loaded: still the message alone
        p.exit(2, f"error: {e}\n")
    if D.world()[0] == 0:
        if args.summary_json:
            write_summary(args.summary_json, summary)
        print(summary_table(summary_rows(summary, _places(summary))), flush=True)
    D.shutdown()
    return 0


def _announce_defaults(cfg) -> None:
    """The one line saying whose defaults the unset keys took (torchrun: from the first rank only)."""
    if os.environ.get("RANK", "0") == "0":
        print(defaults_line(cfg), flush=True)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that name a key, file or row and what to do: shown without a traceback."""
    from rlhf.train.check import CheckFailed  # not at module level: see `main`

    return ConfigError, CheckFailed, DataValidationError, ModelLoadError, CorruptCheckpointError


def _places(summary: dict) -> dict[str, str]:
    out = summary.get("output_dir", "")
    return {"outputs": out, "summary": str(Path(out) / "summary.json") if out else "",
            "final policy": summary.get("final_policy", ""), "MLflow run": summary.get("mlflow_run", "")}
