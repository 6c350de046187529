"""The PPO update: actor and critic DeepSpeed engines and a frozen reference.

A round's buffer holds `steps_per_round` steps of responses. The stages, each timed:

1. `behaviour_log_probs` - old log-probs of the round-start policy, for the whole buffer
   (computed before the first update, so every step of the round is off-policy from the
   same behaviour policy; S = 1 is verl's on-policy PPO); in rollout correction's bypass
   mode the rollout's own log-probs instead;
2. `reference_log_probs` - the frozen reference, for the whole buffer;
then per step: 3. `critic_values` with the current critic, 4. `advantages`, in verl's order:
`rewards` (the score at the last token, minus the KL penalty when `use_kl_in_reward`),
`rollout_correction` (IS weights and rejection from the rollout log-probs,
`rlhf.algos.correction`; the rejection mask then serves everything below), `estimate` (the
`algorithm.adv_estimator` of `algos.ADV_ESTIMATORS`, whitening over all ranks),
5. `update_critic`, 6. `update_actor` (not during the first `trainer.critic_warmup` steps).
The KL controller moves once per step, as verl's does.

How it departs from the textbook: advantages are whitened per step over the global batch
(verl's `compute_gae_advantage_return`); a mini-batch whose loss or gradients are not
finite (NaN/inf logits, rewards, values or advantages end there) is dropped, never
applied, and the step counted as skipped; a non-finite KL never moves the KL controller.
Out of device memory becomes a `RecoverableOOMError` naming the batch settings to lower.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from rlhf.algos.advantages import compute_advantages, compute_token_level_rewards
from rlhf.algos.correction import bypass_policy_loss, compute_rollout_correction
from rlhf.algos.kl import kl_penalty, make_kl_controller
from rlhf.algos.losses import agg_loss, policy_loss, value_loss
from rlhf.algos.masked import explained_variance
from rlhf.algos.mismatch import log_prob_diff_metrics, probs_diff_metrics
from rlhf.config.correction import correction_settings
from rlhf.config.schema import ConfigError, PPOConfig
from rlhf.config.sizes import Sizes
from rlhf.trainer import dist as D
from rlhf.trainer import forward as F
from rlhf.trainer.batch import PPOBatch
from rlhf.trainer.engines import NonFiniteGuard, build_engine, ds_config, local_grad_norm, prepare_module, skip_step
from rlhf.trainer.faults import oom_as_recoverable, update_memory_settings


@dataclass
class Timer:
    times: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        with torch.profiler.record_function(name):  # the stage's range in `trainer.profile_steps` traces
            yield
        self.times[f"timing_s/{name}"] = self.times.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0


def _stats(prefix: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    v = x[mask.bool()] if mask is not None else x.flatten()
    if v.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/max": float(v.max()), f"{prefix}/min": float(v.min())}


class PPOTrainer:
    """Owns the actor, critic and reference; `round()` runs the PPO steps over one buffer."""

    def __init__(self, cfg: PPOConfig, sizes: Sizes, actor: torch.nn.Module, critic: torch.nn.Module | None,
                 ref: torch.nn.Module | None, device: torch.device):
        self.cfg, self.sizes, self.device = cfg, sizes, device
        a, c = cfg.actor, cfg.critic
        actor, critic = prepare_module(actor, cfg), prepare_module(critic, cfg) if critic is not None else None
        self.actor = build_engine(actor.to(device), ds_config(cfg, a.lr, a.weight_decay, a.grad_clip,
                                                              sizes.micro_batch_per_gpu, device))
        self.actor_guard = NonFiniteGuard(self.actor)
        self.critic = None
        if critic is not None:
            self.critic = build_engine(critic.to(device), ds_config(cfg, c.lr, c.weight_decay, c.grad_clip,
                                                                    c.ppo_micro_batch_size_per_gpu, device))
            self.critic_guard = NonFiniteGuard(self.critic)
        self.ref = ref.to(device).eval() if ref is not None else None
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.correction = correction_settings(cfg)
        if self.correction.bypass_mode and self.correction.rollout_is_batch_normalize and D.world()[1] > 1:
            raise ConfigError("algorithm.rollout_correction: bypass_mode with rollout_is_batch_normalize normalises "
                              "inside the loss, over each micro-batch; verl takes that mean over all data-parallel "
                              "ranks, which needs equal micro-batch counts on every rank. Run on one rank or drop "
                              "rollout_is_batch_normalize")
        self.global_step = 0  # PPO steps done (restored from the round state); critic_warmup counts these
        self.skipped_steps = 0  # PPO steps with at least one dropped (non-finite) update
        self._skipped_updates = 0  # dropped optimizer updates in the current step
        self.timer = Timer()

    # -- helpers ---------------------------------------------------------------------
    @property
    def _packed(self) -> bool:
        return self.cfg.data.use_sequence_packing

    def _fwd_kw(self, micro: int = 0) -> dict:
        """Forward settings of the no-grad passes; `micro` > 0 replaces the update's micro-batch size."""
        a = self.cfg.actor
        return dict(micro=micro or self.sizes.micro_batch_per_gpu, packed=self._packed, dynamic=a.use_dynamic_bsz,
                    max_tokens=a.ppo_max_token_len_per_gpu)

    # -- stages ------------------------------------------------------------------------
    def behaviour_log_probs(self, buf: PPOBatch) -> PPOBatch:
        if self.correction.bypass_mode:
            if buf.rollout_log_probs is None:
                raise ValueError("algorithm.rollout_correction.bypass_mode anchors PPO at the rollout log-probs, but "
                                 "these rollouts have none (a stored table without rollout_logprobs); keep them, or "
                                 "turn bypass_mode off")
            return buf.with_(old_log_probs=buf.rollout_log_probs)  # PPO anchored at the sampler's log-probs
        with self.timer("old_log_prob"):
            self.actor.module.eval()
            lp = F.batched_log_probs(self.actor.module, buf, temperature=self.cfg.rollout.temperature,
                                     **self._fwd_kw(self.cfg.rollout.log_prob_micro_batch_size_per_gpu))
        return buf.with_(old_log_probs=lp)

    def reference_log_probs(self, buf: PPOBatch) -> PPOBatch:
        if self.ref is None:
            return buf
        with self.timer("ref"):
            lp = F.batched_log_probs(self.ref, buf, temperature=self.cfg.rollout.temperature,
                                     **self._fwd_kw(self.cfg.ref.log_prob_micro_batch_size_per_gpu))
        return buf.with_(ref_log_probs=lp)

    def critic_values(self, batch: PPOBatch) -> PPOBatch:
        if self.critic is None:
            return batch
        with self.timer("values"):
            self.critic.module.eval()
            kw = self._fwd_kw()
            kw["micro"] = self.cfg.critic.ppo_micro_batch_size_per_gpu
            v = F.batched_values(self.critic.module, batch, **kw)
        return batch.with_(values=v)

    def rewards(self, batch: PPOBatch) -> tuple[PPOBatch, dict[str, float]]:
        """Token-level rewards: the score at the last response token, minus `kl_coef` x the KL
        penalty when `use_kl_in_reward` (verl's `apply_kl_penalty`); the KL controller moves."""
        alg, mask = self.cfg.algorithm, batch.response_mask
        metrics: dict[str, float] = {}
        kl = None
        if batch.ref_log_probs is not None:
            kl = kl_penalty(batch.old_log_probs, batch.ref_log_probs, alg.kl_penalty) * mask
        in_reward = alg.use_kl_in_reward and kl is not None
        rewards, _ = compute_token_level_rewards(batch.scores, mask, kl=kl if in_reward else None,
                                                 kl_coef=self.kl_ctrl.value if in_reward else 0.0)
        if kl is not None:  # mean over responses of each response's token-mean KL, over all ranks (verl)
            seq_kl = D.all_reduce_sum(torch.stack([(kl.sum(-1) / mask.sum(-1).clamp(min=1)).sum(),
                                                   torch.tensor(float(len(batch)), device=kl.device)]))
            current_kl = float(seq_kl[0] / seq_kl[1])
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_penalty_coeff"] = self.kl_ctrl.value if in_reward else 0.0
            metrics["actor/current_kl"] = current_kl
            if in_reward and math.isfinite(current_kl):
                self.kl_ctrl.update(current_kl=current_kl, n_steps=self.sizes.responses_per_step)
        return batch.with_(token_level_rewards=rewards), metrics

    def rollout_correction(self, batch: PPOBatch) -> tuple[PPOBatch, dict[str, float]]:
        """IS weights and the rejection mask from the rollout log-probs against the PPO anchor
        (`old_log_probs`), before the advantages (verl's decoupled mode). A batch without
        rollout log-probs is left as it is; in bypass mode the loss corrects instead."""
        if batch.rollout_log_probs is None or self.correction.bypass_mode:
            return batch, {}
        rc = self.correction
        old, roll, mask = batch.old_log_probs, batch.rollout_log_probs, batch.response_mask
        corr, metrics = compute_rollout_correction(
            old, roll, mask, rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize, rc.rollout_rs,
            rc.rollout_rs_threshold, batch_mean=D.masked_mean_global)
        metrics.update(probs_diff_metrics(old, roll, mask))
        metrics.update(log_prob_diff_metrics(old, roll, mask))
        return batch.with_(rollout_is_weights=corr.weights, loss_mask=corr.mask), metrics

    def estimate(self, batch: PPOBatch) -> tuple[PPOBatch, dict[str, float]]:
        """The `algorithm.adv_estimator` over the tokens that train (`train_mask`); the group
        estimators sum each response's rewards over its whole response, rejected tokens
        included, as verl's do."""
        alg, mask = self.cfg.algorithm, batch.train_mask
        adv, ret = compute_advantages(alg.adv_estimator, batch.token_level_rewards, mask, values=batch.values,
                                      group_ids=batch.group_ids, gamma=alg.gamma, lam=alg.lam,
                                      norm_by_std=alg.norm_adv_by_std_in_grpo, whiten=D.masked_whiten_global,
                                      reward_mask=batch.response_mask)
        metrics = _stats("critic/rewards", batch.token_level_rewards.sum(-1))
        metrics.update(_stats("critic/advantages", adv, mask))
        metrics.update(_stats("critic/returns", ret, mask))
        if batch.values is not None:
            metrics.update(_stats("critic/values", batch.values, mask))
        return batch.with_(advantages=adv, returns=ret), metrics

    def advantages(self, batch: PPOBatch) -> tuple[PPOBatch, dict[str, float]]:
        """verl's advantage stage, in its order: rewards (KL penalty), rollout correction, the
        estimator; one rejection mask then serves the estimator, the critic and the actor."""
        with self.timer("adv"):
            batch, metrics = self.rewards(batch)
            batch, m = self.rollout_correction(batch)
            metrics.update(m)
            batch, m = self.estimate(batch)
        metrics.update(m)
        return batch, metrics

    def _mini_batches(self, batch: PPOBatch) -> list[PPOBatch]:
        """Consecutive mini-batches; with `actor.shuffle` the rows are reshuffled first (a new
        permutation each epoch, drawn from the round's seeded torch RNG)."""
        n = self.sizes.mini_batch_per_gpu
        if self.cfg.actor.shuffle:
            batch = batch.select(torch.randperm(len(batch)).to(batch.input_ids.device))
        return [batch.select(slice(i, i + n)) for i in range(0, len(batch), n)]

    def _micro(self, mini: PPOBatch, micro: int) -> list[PPOBatch]:
        a = self.cfg.actor
        return F.micro_batches(mini, micro, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu)

    def _denominators(self, mb: PPOBatch) -> dict[str, float]:
        """What verl's engine divides the losses by, from the mask before any rejection: the
        sequence means count a response the correction rejected whole (verl's
        `global_batch_size` is the mini-batch's), and in bypass mode the token mean counts the
        tokens the loss itself rejects (verl's token count is taken before the loss runs)."""
        d = {"global_batch_size": float((mb.response_mask.sum(-1) > 0).sum().clamp_min(1))}
        if self.correction.bypass_mode:
            d["batch_num_tokens"] = float(mb.response_mask.sum().clamp_min(1))
        return d

    def _pg_loss(self, lp: torch.Tensor, mb: PPOBatch) -> tuple[torch.Tensor, dict]:
        """The policy-gradient term: PPO's clipped surrogate with the IS weights over the
        tokens that train, or in bypass mode verl's `bypass_mode` loss, which corrects
        against the current policy itself."""
        a, rc = self.cfg.actor, self.correction
        low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
        high = a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio
        if rc.bypass_mode:
            return bypass_policy_loss(lp, mb.old_log_probs, mb.advantages, mb.train_mask, low, high, a.clip_ratio_c,
                                      a.loss_agg_mode, loss_type=rc.loss_type, rollout_is=rc.rollout_is,
                                      rollout_is_threshold=rc.rollout_is_threshold,
                                      rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
                                      rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold,
                                      **self._denominators(mb))
        return policy_loss(lp, mb.old_log_probs, mb.advantages, mb.train_mask, low, high, a.clip_ratio_c,
                           a.loss_agg_mode, rollout_is_weights=mb.rollout_is_weights, **self._denominators(mb))

    def _actor_loss(self, mb: PPOBatch) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.cfg.actor
        lp, ent = F.log_probs(self.actor, mb, self.cfg.rollout.temperature, self._packed, with_entropy=True)
        mask, denominators = mb.train_mask, self._denominators(mb)
        pg_loss, m = self._pg_loss(lp, mb)
        entropy = agg_loss(ent, mask, a.loss_agg_mode, **denominators)
        loss = pg_loss - a.entropy_coeff * entropy
        metrics = {"actor/pg_loss": float(pg_loss.detach()), "actor/entropy": float(entropy.detach()),
                   **{(k if "/" in k else f"actor/{k}"): float(v) for k, v in m.items()}}
        if a.use_kl_loss and mb.ref_log_probs is not None:
            kl = kl_penalty(lp, mb.ref_log_probs, a.kl_loss_type)
            kl_loss = agg_loss(kl, mask, a.loss_agg_mode, **denominators)
            loss = loss + a.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = float(kl_loss.detach())
            metrics["actor/kl_coef"] = a.kl_loss_coef
        return loss, metrics

    def _critic_loss(self, mb: PPOBatch) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg.critic
        v = F.values(self.critic, mb, self._packed)
        loss, m = value_loss(v, mb.values, mb.returns, mb.train_mask, c.cliprange_value, c.loss_agg_mode,
                             global_batch_size=self._denominators(mb)["global_batch_size"])
        return loss, {"critic/vf_loss": float(loss.detach()), **{f"critic/{k}": float(x) for k, x in m.items()}}

    def _optimize(self, engine, guard: NonFiniteGuard, batch: PPOBatch, epochs: int, micro: int, loss_fn,
                  prefix: str) -> dict[str, float]:
        """`epochs` passes of mini-batch SGD with gradient accumulation over micro-batches."""
        engine.train()
        sums: dict[str, float] = {}
        count = 0
        grad_norms = []
        for _ in range(epochs):
            for mini in self._mini_batches(batch):
                guard.reset()
                finite = True
                for mb in self._micro(mini, micro):
                    with torch.profiler.record_function(f"{prefix}/forward"):
                        loss, m = loss_fn(mb)
                    finite &= bool(torch.isfinite(loss))
                    if not finite:
                        break  # the rest of this mini-batch would be dropped anyway
                    with torch.profiler.record_function(f"{prefix}/backward"):
                        engine.backward(loss * (len(mb) / len(mini)), scale_wrt_gas=False)
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + v
                    count += 1
                with torch.profiler.record_function(f"{prefix}/grad_norm"):
                    gn = local_grad_norm(engine)
                bad = D.all_reduce_max(torch.tensor(0.0 if finite else 1.0)).item() > 0 or guard.tripped()
                if gn is not None:
                    gn = math.sqrt(D.all_reduce_sum(torch.tensor(gn * gn)).item() / D.world()[1])
                bad |= gn is not None and not math.isfinite(gn)
                if bad:
                    skip_step(engine)
                    self._skipped_updates += 1
                    continue
                with torch.profiler.record_function(f"{prefix}/optimizer_step"):
                    engine.step()
                if gn is None:
                    gn = engine.get_global_grad_norm()
                if gn is not None:
                    grad_norms.append(float(gn))
        out = {k: v / max(count, 1) for k, v in sums.items()}
        if grad_norms:
            out[f"{prefix}/grad_norm"] = sum(grad_norms) / len(grad_norms)
        out[f"{prefix}/lr"] = engine.get_lr()[0]
        return out

    def update_actor(self, batch: PPOBatch) -> dict[str, float]:
        with self.timer("update_actor"):
            return self._optimize(self.actor, self.actor_guard, batch, self.cfg.actor.ppo_epochs,
                                  self.sizes.micro_batch_per_gpu, self._actor_loss, "actor")

    def update_critic(self, batch: PPOBatch) -> dict[str, float]:
        if self.critic is None:
            return {}
        with self.timer("update_critic"):
            m = self._optimize(self.critic, self.critic_guard, batch, self.cfg.critic.ppo_epochs,
                               self.cfg.critic.ppo_micro_batch_size_per_gpu, self._critic_loss, "critic")
        m["critic/vf_explained_var"] = float(explained_variance(batch.values, batch.returns, batch.train_mask))
        return m

    # -- composition -----------------------------------------------------------------------
    def step(self, batch: PPOBatch) -> dict[str, float]:
        """One PPO step over one step's share of the buffer (behaviour/ref log-probs present)."""
        self.timer = Timer()
        self._skipped_updates = 0
        batch = self.critic_values(batch)
        batch, metrics = self.advantages(batch)
        metrics.update(self.update_critic(batch))
        if self.global_step >= self.cfg.trainer.critic_warmup:
            metrics.update(self.update_actor(batch))
        metrics["training/critic_warmup"] = float(self.global_step < self.cfg.trainer.critic_warmup)
        self.global_step += 1
        metrics = D.mean_across_ranks(metrics)
        metrics.update(_stats("critic/score", D.all_gather_cat(batch.scores)))
        self.skipped_steps += int(self._skipped_updates > 0)  # the same on every rank: `bad` is reduced
        metrics["training/skipped_steps"] = float(self.skipped_steps)
        metrics["training/step_skipped"] = float(self._skipped_updates > 0)
        metrics["training/skipped_updates"] = float(self._skipped_updates)
        metrics.update(self.timer.times)
        return metrics

    def round(self, buf: PPOBatch, steps: int) -> list[dict[str, float]]:
        """Run `steps` PPO steps over the round's buffer; returns one metrics dict per step."""
        with oom_as_recoverable("PPO update", update_memory_settings(self.cfg)):
            return self._round(buf, steps)

    def _round(self, buf: PPOBatch, steps: int) -> list[dict[str, float]]:
        buf = self.behaviour_log_probs(buf)
        buf = self.reference_log_probs(buf)
        head_times = dict(self.timer.times)
        per_step = len(buf) // steps
        out = []
        for s in range(steps):
            m = self.step(buf.select(slice(s * per_step, (s + 1) * per_step)))
            if s == 0:
                for k, v in head_times.items():
                    m[k] = m.get(k, 0.0) + v
            out.append(m)
        return out

