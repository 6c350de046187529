"""verl 0.9.1's own functions and config objects, for tests that hold this project to verl
on the same inputs (the wheel is installed without its dependencies; `pytest.importorskip`
is not used: a missing verl is a broken test set-up, not a skipped feature).

- `batch(...)`: random rollouts as plain tensors (groups of responses, uneven lengths,
  garbage at padded positions) and `data_proto(...)`: the same as verl's `DataProto`.
- `rollout_corr_helper`, `core_algos`, `calculate_debug_metrics`: verl's modules and function.
- `rollout_corr_config(**kw)` / `preset(name)` / `PRESETS`: verl's `RolloutCorrectionConfig`.
- `actor_config(...)`: verl's `FSDPActorConfig` as its policy losses read it.
- `apply_kl_penalty`, `compute_advantage`: verl's own functions from `ray_trainer.py`, whose
  module imports need packages the test set-up leaves out (torchdata, datasets): the two
  function bodies are compiled from the installed file, unchanged, in a namespace that
  holds what they use.
- `advantage_stage(...)`: verl's trainer step between the reference log-probs and the
  update, in its order: KL penalty, rollout correction, advantages.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import verl
from verl import DataProto
from verl.trainer.config.algorithm import AlgoConfig, KLControlConfig, RolloutCorrectionConfig
from verl.trainer.ppo import core_algos, rollout_corr_helper  # noqa: F401 (re-exported for tests)
from verl.trainer.ppo.core_algos import AdvantageEstimator, FixedKLController
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: F401 (re-exported for tests)
from verl.utils.torch_functional import masked_mean
from verl.workers.config.actor import FSDPActorConfig, PolicyLossConfig

PRESETS = [name for name, v in vars(RolloutCorrectionConfig).items() if isinstance(v, classmethod)]
CORRECTION_FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                     "rollout_rs_threshold", "bypass_mode", "loss_type")


def _from_ray_trainer(*names: str) -> dict[str, Any]:
    """verl's module-level functions `names` from the installed `ray_trainer.py`, compiled as
    they are, with the names they use bound to verl's own objects."""
    path = Path(verl.__file__).parent / "trainer" / "ppo" / "ray_trainer.py"
    tree = ast.parse(path.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    for n in nodes:
        n.decorator_list = []
    ns: dict[str, Any] = dict(torch=torch, np=np, core_algos=core_algos, masked_mean=masked_mean, DataProto=DataProto,
                              AdvantageEstimator=AdvantageEstimator, AlgoConfig=AlgoConfig, Optional=Optional)
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), ns)
    return {n: ns[n] for n in names}


_RT = _from_ray_trainer("apply_kl_penalty", "compute_response_mask", "compute_advantage")
apply_kl_penalty, compute_advantage = _RT["apply_kl_penalty"], _RT["compute_advantage"]


def batch(seed: int, n_groups: int = 3, group_size: int = 4, width: int = 7, spread: float = 0.3,
          garbage: float = 50.0) -> dict[str, torch.Tensor]:
    """Random rollouts in float64: groups of `group_size` responses of 1..width tokens.

    Keys: response_mask (B, T), old/rollout/ref log-probs and values (B, T) with garbage
    (uniform in +-`garbage`) at padded positions, scores (B,), group_ids (B,) and
    token_level_scores (B, T) (the score at the last valid token, zeros elsewhere, as verl's
    reward managers write it). `spread` scales the rollout's log-prob noise.
    """
    g = torch.Generator().manual_seed(seed)
    B = n_groups * group_size
    lengths = torch.randint(1, width + 1, (B,), generator=g)
    lengths[0] = width  # one full-width response
    mask = (torch.arange(width).expand(B, width) < lengths.unsqueeze(-1)).to(torch.float64)
    old = -torch.rand(B, width, generator=g, dtype=torch.float64) * 3 - 0.01
    rollout = (old + spread * torch.randn(B, width, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    ref = old + 0.2 * torch.randn(B, width, generator=g, dtype=torch.float64)
    values = torch.randn(B, width, generator=g, dtype=torch.float64)
    scores = torch.randint(0, 2, (B,), generator=g).to(torch.float64)
    junk = lambda: (torch.rand(B, width, generator=g, dtype=torch.float64) * 2 - 1) * garbage  # noqa: E731
    out = dict(response_mask=mask, scores=scores, group_ids=torch.arange(n_groups).repeat_interleave(group_size))
    for k, v in dict(old_log_probs=old, rollout_log_probs=rollout, ref_log_prob=ref, values=values).items():
        out[k] = torch.where(mask.bool(), v, junk())
    last = (lengths - 1).unsqueeze(-1)
    out["token_level_scores"] = torch.zeros(B, width, dtype=torch.float64).scatter(1, last, scores.unsqueeze(-1))
    return out


def data_proto(b: dict[str, torch.Tensor]) -> DataProto:
    """`batch(...)` as verl's DataProto (tensors cloned; group ids as the `uid` column)."""
    tensors = {k: v.clone() for k, v in b.items() if k not in ("scores", "group_ids")}
    uid = np.array([f"g{int(i)}" for i in b["group_ids"]], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


def rollout_corr_config(**kw) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig(**kw)


def preset(name: str) -> RolloutCorrectionConfig:
    """verl's `RolloutCorrectionConfig.<name>()` with its default arguments."""
    return getattr(RolloutCorrectionConfig, name)()


def correction_kwargs(rc: Any) -> dict[str, Any]:
    """The five arguments of verl's `compute_rollout_correction_and_rejection_mask` from a
    correction config (verl's or this project's)."""
    return {k: getattr(rc, k) for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                                        "rollout_rs", "rollout_rs_threshold")}


def actor_config(clip_ratio: float = 0.2, clip_ratio_c: float = 3.0, loss_agg_mode: str = "token-mean",
                 rollout_correction: Optional[RolloutCorrectionConfig] = None) -> FSDPActorConfig:
    """verl's actor config as its policy losses read it; with `rollout_correction` its policy
    loss is `bypass_mode` (what verl's `apply_bypass_mode` sets)."""
    loss = PolicyLossConfig() if rollout_correction is None else PolicyLossConfig(
        loss_mode="bypass_mode", rollout_correction=rollout_correction)
    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                           clip_ratio=clip_ratio, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                           policy_loss=loss)


def advantage_stage(b: dict[str, torch.Tensor], rc: Optional[RolloutCorrectionConfig], adv_estimator: str,
                    kl_coef: float = 0.1, kl_penalty: str = "kl", gamma: float = 1.0, lam: float = 1.0,
                    norm_adv_by_std_in_grpo: bool = True) -> tuple[DataProto, dict[str, float]]:
    """verl's step from the log-probs to the update (KL in the reward on): `apply_kl_penalty`,
    `compute_rollout_correction_and_add_to_batch` (decoupled mode), `compute_advantage`.
    Returns the batch (advantages, returns, response_mask, rollout_is_weights, ...) and the
    metrics."""
    data = data_proto(b)
    ctrl = FixedKLController(kl_coef)
    data, metrics = apply_kl_penalty(data, kl_ctrl=ctrl, kl_penalty=kl_penalty)
    if rc is not None and not rc.bypass_mode:
        data, m = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(data, rc)
        metrics.update(m)
    algo = AlgoConfig(gamma=gamma, lam=lam, adv_estimator=adv_estimator,
                      norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
                      kl_ctrl=KLControlConfig(kl_coef=kl_coef), rollout_correction=rc)
    data = compute_advantage(data, adv_estimator=adv_estimator, gamma=gamma, lam=lam,
                             norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=algo)
    return data, metrics


def close(a: float, b: float, rel: float = 1e-6, abs_: float = 1e-9) -> bool:
    """Floats equal up to rounding (NaN equals NaN, infinities compare exactly)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)
