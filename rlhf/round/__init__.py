"""The pieces a driver composes into a PPO round: the stages as plain functions
(`stages`: data, sample, rollout, score, update; `partition`: rows balanced over ranks),
the starting policy (`policy`), the rules both drivers follow (`rules`: seeds, validation
schedule, per-step metrics, the summary), the state that crosses rounds and the
early-stopping decision (`state`), validation (`evaluate`), and stored rollouts
standing in for the rollout stage (`offline`). Checkpoints are `rlhf.checkpoint`, a layer
above this one.

May import: `rlhf.config`, `rlhf.data`, `rlhf.algos`, `rlhf.models`, `rlhf.rewards`,
`rlhf.rollout`, `rlhf.trainer`, `schemas`. Never tracking or the drivers (`rlhf.train`):
a round's pieces know nothing of where metrics go or which driver runs them.
Submodules are imported directly (`from rlhf.round import stages`).
"""
