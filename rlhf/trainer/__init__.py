"""The PPO update and the SFT warm-start: DeepSpeed engines for the actor, critic and
frozen reference (`engines`, `ds_ops`, `master_adam`), the packed forward passes
(`forward`, `batch`), the update loop over PPO epochs and micro-batches (`ppo`), process
groups and collectives (`dist`), faults that say what setting to change (`faults`), and the SFT
warm-start of the tiny default policy (`sft`, `default_policy`).

May import: `rlhf.config`, `rlhf.data`, `rlhf.algos`, `rlhf.models`, `rlhf.rollout` (the
warm-start's greedy check). Submodules are imported directly.
"""
