"""KL estimators (`KL_ESTIMATORS`, `kl_penalty`) and KL coefficient controllers
(`KL_CONTROLLERS`, `make_kl_controller`), named as verl's `algorithm.kl_penalty` and
`algorithm.kl_ctrl.type`.
"""

from __future__ import annotations

import torch

from rlhf.config.registry import Registry

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------
# KL estimators: J. Schulman, "Approximating KL Divergence" (2020),
# http://joschu.net/blog/kl-approx.html. With r = p_ref(x) / p(x) and x ~ p:
#   k1 = -log r            unbiased, high variance, can be negative
#   k2 = 0.5 (log r)^2     biased, low variance, >= 0
#   k3 = (r - 1) - log r   unbiased, low variance, >= 0
# ---------------------------------------------------------------------------------

KL_ESTIMATORS: Registry = Registry("kl estimator")


@KL_ESTIMATORS.register("kl", "k1")
def kl_k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def kl_abs(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return (logprob - ref_logprob).abs()


@KL_ESTIMATORS.register("mse", "k2")
def kl_k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3")
def kl_k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    # Clamps as verl: log r to [-20, 20] so exp stays finite, the estimate to [-10, 10].
    log_r = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (torch.exp(log_r) - log_r - 1).clamp(-10.0, 10.0)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate of `kind` (see KL_ESTIMATORS.names()).

    logprob, ref_logprob: (B, T) log-probs of the sampled tokens -> (B, T).
    """
    return KL_ESTIMATORS.get(kind)(logprob, ref_logprob)


# ---------------------------------------------------------------------------------
# KL coefficient controllers
# ---------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient `value`."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences" (arXiv:1909.08593), section 2.2: a proportional controller that
    steers the observed KL towards `target_kl`, by at most 20% of n_steps/horizon per update.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0 for the adaptive KL controller, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0 for the adaptive KL controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """value *= 1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


KL_CONTROLLERS: Registry = Registry("kl controller")
KL_CONTROLLERS.add("fixed", lambda kl_coef, target_kl, horizon: FixedKLController(kl_coef))
KL_CONTROLLERS.add("adaptive", lambda kl_coef, target_kl, horizon: AdaptiveKLController(kl_coef, target_kl, horizon))


def make_kl_controller(type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    """`FixedKLController` or `AdaptiveKLController` by name (`algorithm.kl_ctrl.type`)."""
    return KL_CONTROLLERS.get(type)(kl_coef, target_kl, horizon)
