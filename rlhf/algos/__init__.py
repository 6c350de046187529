"""PPO math as pure tensor functions, chosen by name through registries.

Owns: masked statistics (`masked`), KL estimators and KL coefficient controllers (`kl`:
`KL_ESTIMATORS`, `KL_CONTROLLERS`), token-level rewards and advantage estimators
(`advantages`: GAE, GRPO and the `ADV_ESTIMATORS` registry; `outcome`: RLOO and
REINFORCE++-baseline, registered there), losses (`losses`: `agg_loss`, `policy_loss`,
`value_loss`, `reinforce_loss`), per-token quantities from logits (`logits`), and rollout
correction, verl 0.9.1's (`correction`: importance weights and bypass mode's loss;
`rejection`: the rejection criteria; `mismatch`: the off-policy diagnostics). Importing the
package imports every submodule, so each registry holds all of its entries; the public
names are re-exported here (`from rlhf.algos import compute_advantages`).

May import: torch (and numpy), `rlhf.config`. Submodules import their siblings directly.

Names and semantics follow verl's `verl/trainer/ppo/core_algos.py`, so the two can be
compared line by line. Tensors are `(B, T)` = (batch, response_len) unless stated, and
`response_mask` is 0/1 over response tokens (1 = the policy produced this token).

Where this package departs from verl:
- Values at masked positions never reach a result: inputs are zeroed there before any
  arithmetic (so NaN or huge padding values are harmless, gradients included), and
  per-token outputs are 0 at masked positions (verl leaves whatever was computed).
- `masked_var` with a single valid element returns 0 instead of raising.
- Loss metrics are detached 0-dim tensors (no device sync per micro-batch); call
  `float()` when logging.
"""

from __future__ import annotations

from rlhf.algos import (  # noqa: F401 (all registered)
    advantages, correction, kl, logits, losses, masked, mismatch, outcome, rejection,
)
from rlhf.algos.advantages import (
    ADV_ESTIMATORS,
    GroupIds,
    compute_advantages,
    compute_gae,
    compute_gae_advantage_return,
    compute_grpo_advantages,
    compute_token_level_rewards,
    gae_estimator,
    grpo_estimator,
)
from rlhf.algos.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    make_kl_controller,
)
from rlhf.algos.logits import entropy_from_logits, logprobs_from_logits
from rlhf.algos.losses import LOSS_AGG_MODES, agg_loss, policy_loss, value_loss
from rlhf.algos.masked import explained_variance, masked_mean, masked_var, masked_whiten

__all__ = [
    "ADV_ESTIMATORS", "KL_CONTROLLERS", "KL_ESTIMATORS", "LOSS_AGG_MODES",
    "AdaptiveKLController", "FixedKLController", "GroupIds",
    "agg_loss", "compute_advantages", "compute_gae", "compute_gae_advantage_return", "compute_grpo_advantages",
    "compute_token_level_rewards", "entropy_from_logits", "explained_variance", "gae_estimator", "grpo_estimator",
    "kl_abs", "kl_k1", "kl_k2", "kl_k3", "kl_penalty", "logprobs_from_logits", "make_kl_controller",
    "masked_mean", "masked_var", "masked_whiten", "policy_loss", "value_loss",
]
