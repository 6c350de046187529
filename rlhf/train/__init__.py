"""The drivers of a run and their command lines.

- `rlhf.train.inprocess`: the in-process driver (`Run`, `run_rounds`, `train`): every round's
  stages in one process, or one per rank under torchrun;
- `rlhf.train.stateless`: one round's stages for a driver that keeps nothing in memory
  between them (the Flyte tasks of `tasks/`);
- `rlhf.train.segment`: a colocated segment of rounds on `Run` (one Flyte task);
- `rlhf.train.step`: a round's update half, the same for all of them (`update_step`, `StepResult`);
- `rlhf.train.report`: the round line with its ETA and the end summary, the same for all of them;
- `rlhf.train.setup`: the process, trainer, engine, sink, validation and checkpoint set-up
  all of them share;
- `rlhf.train.cli` (`python -m rlhf.train`), `rlhf.train.check` (launch preflight,
  `python -m rlhf.train.check`), `rlhf.train.sft` (the SFT command line).

This package may import everything below it in the layer order (config, data, algos,
models, rewards, rollout, trainer, round, checkpoint, tracking), never flytekit, `tasks`, `workflows`
or `sweeps`. `rlhf.train(cfg)` is `train(cfg)`: the module is callable.
"""

from __future__ import annotations

import sys

from rlhf.config.schema import PPOConfig
from rlhf.train.cli import main
from rlhf.checkpoint.verify import resume_candidates
from rlhf.train.inprocess import Run, run_rounds, train

__all__ = ["Run", "main", "resume_candidates", "run_rounds", "train"]


class _CallableModule(type(sys)):
    """Lets `rlhf.train(cfg)` call `train(cfg)` while `python -m rlhf.train` stays a module."""

    def __call__(self, cfg: PPOConfig) -> dict:
        return train(cfg)


sys.modules[__name__].__class__ = _CallableModule
