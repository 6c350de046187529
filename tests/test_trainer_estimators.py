"""Advantage estimators, the KL terms, rollout correction, critic warm-up and mini-batch
shuffling through `PPOTrainer` (real DeepSpeed engines, gloo on CPU) against hand values,
and its advantage stage and bypass-mode loss against verl 0.9.1's own functions."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rlhf.config import RolloutCorrectionConfig, derive_sizes, load_config
from rlhf.trainer import dist as D
from rlhf.trainer import forward as F
from rlhf.trainer.batch import PPOBatch, collate
from tests import verl_reference as V

SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.num_attention_heads=2",
         "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=64", "data.train_batch_size=2",
         "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=2", "rollout.n=2",
         "critic.ppo_micro_batch_size_per_gpu=2", "data.max_response_length=3", "data.max_prompt_length=4",
         "actor.lr=1e-2", "critic.lr=1e-2", "trainer.device=cpu", "trainer.logger=[none]"]


def make_trainer(*overrides: str, critic: bool = False):
    from rlhf.trainer.default_policy import build_tiny_policy
    from rlhf.models.load import ValueModel
    from rlhf.trainer.ppo import PPOTrainer

    torch.set_num_threads(1)
    device = torch.device("cpu")
    D.init_distributed(device)
    cfg = load_config(None, SMALL + list(overrides))
    model, tok = build_tiny_policy(cfg)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    value = ValueModel(copy.deepcopy(model.model)) if critic else None
    return PPOTrainer(cfg, derive_sizes(cfg, 1), model, value, ref, device), tok


def hand_batch(scores, group_ids, rollout_log_probs=None):
    """Four responses of 2 or 3 tokens to two-token prompts."""
    prompts = [[5, 6], [5, 6], [7, 8], [7, 8]][:len(scores)]
    responses = [[10, 11, 12], [13, 14], [15, 16, 17], [18, 19]][:len(scores)]
    return collate(prompts, responses, scores, group_ids, pad_id=0, rollout_log_probs=rollout_log_probs,
                   prompt_width=4, response_width=3)


MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0], [-0.3, -0.7, -1.1], [-2.0, -0.1, 0.0]])
REF = torch.tensor([[-1.2, -1.0, -0.5], [-1.0, -0.4, 0.0], [-0.3, -0.2, -1.6], [-1.0, -0.3, 0.0]])


def grpo_hand(totals, groups, eps=1e-6):
    totals = torch.as_tensor(totals, dtype=torch.float64)
    out = torch.empty_like(totals)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        v = totals[idx]
        out[idx] = (v - v.mean()) / (v.std() + eps)
    return out


def test_grpo_with_kl_in_reward_through_trainer():
    trainer, _ = make_trainer("algorithm.adv_estimator=grpo", "algorithm.kl_ctrl.kl_coef=0.1",
                              "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl")
    scores, groups = [1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0]
    batch = hand_batch(scores, groups).with_(old_log_probs=OLD, ref_log_probs=REF)
    out, metrics = trainer.advantages(batch)
    kl = ((OLD - REF) * MASK).sum(-1)  # k1 summed over each response: 0.8, -0.3, 0.0, -0.8
    expected = grpo_hand([s - 0.1 * k for s, k in zip(scores, kl.tolist())], groups)
    assert torch.allclose(out.advantages[:, 0].double(), expected, atol=1e-5)
    assert torch.all(out.advantages[MASK == 0] == 0)
    raw = grpo_hand(scores, groups)  # what the advantages were before: the penalty never arrived
    assert not torch.allclose(out.advantages[:, 0].double(), raw, atol=1e-3)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert torch.allclose(out.token_level_rewards.sum(-1), torch.tensor(scores) - 0.1 * kl)


def test_grpo_with_kl_as_a_loss_through_trainer():
    trainer, _ = make_trainer("algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
                              "actor.use_kl_loss=true", "actor.kl_loss_coef=0.5", "actor.kl_loss_type=low_var_kl",
                              "actor.entropy_coeff=0.0")
    scores, groups = [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1]
    batch = hand_batch(scores, groups)
    lp, _ = F.log_probs(trainer.actor, batch, trainer.cfg.rollout.temperature, packed=False)
    lp = lp.detach()
    batch = batch.with_(old_log_probs=lp, ref_log_probs=lp + REF - OLD)
    batch, _ = trainer.advantages(batch)
    expected_adv = grpo_hand(scores, groups)  # no KL in the reward: raw scores, groups of two
    assert torch.allclose(batch.advantages[:, 0].double(), expected_adv, atol=1e-5)
    loss, m = trainer._actor_loss(batch)
    valid = batch.response_mask.bool()
    log_r = (REF - OLD)  # ref - logprob at the sampled tokens
    k3 = (log_r.exp() - log_r - 1)[valid]
    pg = -(batch.advantages[valid]).mean()  # ratio 1 (old = current): -A, token mean
    assert m["actor/kl_loss"] == pytest.approx(float(k3.mean()), abs=1e-5)
    assert float(loss.detach()) == pytest.approx(float(pg + 0.5 * k3.mean()), abs=1e-5)


def test_rloo_through_trainer():
    trainer, _ = make_trainer("algorithm.adv_estimator=rloo", "algorithm.use_kl_in_reward=false")
    batch = hand_batch([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0]).with_(old_log_probs=OLD, ref_log_probs=REF)
    out, _ = trainer.advantages(batch)
    # each score minus the mean of the other three: 1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3
    assert torch.allclose(out.advantages[:, 0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]), atol=1e-6)
    assert trainer.critic is None


def test_reinforce_plus_plus_baseline_through_trainer():
    trainer, _ = make_trainer("algorithm.adv_estimator=reinforce_plus_plus_baseline",
                              "algorithm.use_kl_in_reward=false")
    batch = hand_batch([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1]).with_(old_log_probs=OLD, ref_log_probs=REF)
    out, _ = trainer.advantages(batch)
    # centred: 0.5, -0.5, 0, 0 on 3, 2, 3, 2 tokens; whitened over those 10 tokens
    centred = torch.tensor([0.5] * 3 + [-0.5] * 2 + [0.0] * 5, dtype=torch.float64)
    mean, std = centred.mean(), centred.std()
    expected = (torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) - mean) / std
    assert torch.allclose(out.advantages[:, 0].double(), expected, atol=1e-5)


def test_rollout_correction_through_trainer_weights_the_loss():
    trainer, _ = make_trainer("algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
                              "algorithm.rollout_correction.rollout_is_threshold=1.5")
    base = hand_batch([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    lp, _ = F.log_probs(trainer.actor, base, trainer.cfg.rollout.temperature, packed=False)
    lp = lp.detach() * base.response_mask
    batch, _ = trainer.advantages(base.with_(old_log_probs=lp, ref_log_probs=lp))
    same, m_same = trainer.rollout_correction(batch.with_(rollout_log_probs=lp.clone()))
    shifted, m = trainer.rollout_correction(batch.with_(rollout_log_probs=lp - 1.0 * base.response_mask))
    assert torch.equal(same.rollout_is_weights, base.response_mask)
    assert m_same["rollout_corr/rollout_is_mean"] == pytest.approx(1.0)
    assert torch.allclose(shifted.rollout_is_weights, 1.5 * base.response_mask)  # e^1 capped at 1.5
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1.0)
    l_plain, _ = trainer._actor_loss(batch)
    l_same, _ = trainer._actor_loss(same)
    l_shift, _ = trainer._actor_loss(shifted)
    assert float(l_same) == pytest.approx(float(l_plain), abs=1e-7)
    assert float(l_shift) == pytest.approx(1.5 * float(l_plain), rel=1e-4)  # entropy_coeff 0


def as_ppo_batch(b: dict) -> PPOBatch:
    """`verl_reference.batch(...)` in the trainer's layout (token ids made up: only the
    log-probs, values and scores given here enter the advantage stage)."""
    B, T = b["response_mask"].shape
    lengths = b["response_mask"].sum(-1).long().tolist()
    pb = collate([[5, 6]] * B, [[10 + j for j in range(n)] for n in lengths], b["scores"].tolist(),
                 b["group_ids"].tolist(), pad_id=0, prompt_width=2, response_width=T)
    return pb.with_(old_log_probs=b["old_log_probs"], ref_log_probs=b["ref_log_prob"],
                    rollout_log_probs=b["rollout_log_probs"], values=b["values"])


@pytest.fixture(scope="module", params=["gae", "grpo"])
def kl_trainer(request):
    trainer, _ = make_trainer(f"algorithm.adv_estimator={request.param}", "algorithm.use_kl_in_reward=true",
                              "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_penalty=kl",
                              critic=request.param == "gae")
    return trainer, request.param


@pytest.mark.parametrize("correction", [
    dict(rollout_is="token", rollout_is_threshold="2.0"),
    dict(rollout_is="token", rollout_is_threshold="0.8_1.25", rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
    dict(rollout_is="sequence", rollout_rs="seq_mean_k3", rollout_rs_threshold="0.03"),
    dict(rollout_is=None, rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="0.05,0.5"),
    dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0", rollout_is_batch_normalize=True,
         rollout_rs="seq_sum_k1", rollout_rs_threshold="0.3_3.0"),
])
def test_advantage_stage_equals_verl(kl_trainer, correction):
    """KL penalty, rollout correction, then the estimator (verl's order): the same rejection
    mask, IS weights, advantages, returns and metrics as verl's `apply_kl_penalty`,
    `compute_rollout_correction_and_add_to_batch` and `compute_advantage`."""
    trainer, estimator = kl_trainer
    trainer.correction = dataclasses.replace(RolloutCorrectionConfig(), **correction)
    b = V.batch(1)
    verl_data, verl_metrics = V.advantage_stage(b, V.rollout_corr_config(**correction), estimator)
    out, metrics = trainer.advantages(as_ppo_batch(b))
    keep = verl_data.batch["response_mask"].bool()
    assert torch.equal(out.train_mask.bool(), keep)
    assert torch.allclose(out.advantages[keep], verl_data.batch["advantages"][keep], atol=1e-7)
    assert torch.allclose(out.returns[keep], verl_data.batch["returns"][keep], atol=1e-7)
    if correction["rollout_is"] is not None:
        assert torch.allclose(out.rollout_is_weights, verl_data.batch["rollout_is_weights"], atol=1e-9)
    wrong = {k: (metrics.get(k), v) for k, v in verl_metrics.items() if not V.close(metrics.get(k, float("nan")), v)}
    assert not wrong, wrong  # actor/reward_kl_penalty (a mean of per-response means) and every rollout_corr/*
    if correction.get("rollout_rs"):
        assert 0 < keep.sum() < b["response_mask"].sum()
        if estimator == "gae":  # the order matters: GAE over the mask before rejection gives other advantages
            before, _ = trainer.estimate(out.with_(loss_mask=None))
            assert (before.advantages - out.advantages)[keep].abs().max() > 1e-3


def test_bypass_mode_rejects_against_the_current_policy_inside_the_loss():
    """Bypass mode anchors PPO at the rollout log-probs; the rejection then compares the policy
    being trained with the rollout (verl's `compute_policy_loss_bypass_mode`), not the rollout
    log-probs with themselves, and the actor's loss equals verl's on the same tensors."""
    trainer, _ = make_trainer("algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
                              "actor.entropy_coeff=0.0", "algorithm.rollout_correction.preset=bypass_ppo_clip_geo_rs")
    base = hand_batch([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    lp, _ = F.log_probs(trainer.actor, base, trainer.cfg.rollout.temperature, packed=False)
    lp = lp.detach() * base.response_mask
    noise = torch.tensor([[0.0, 0.0, 0.0], [0.3, -0.2, 0.0], [0.0, 0.0, 0.0], [-0.4, 0.5, 0.0]])
    buf = trainer.behaviour_log_probs(base.with_(rollout_log_probs=lp + noise))
    assert torch.equal(buf.old_log_probs, buf.rollout_log_probs)
    batch, m_adv = trainer.advantages(buf.with_(ref_log_probs=buf.old_log_probs))
    assert batch.loss_mask is None and not any(k.startswith("rollout_corr/") for k in m_adv)  # in the loss instead
    loss, m = trainer._actor_loss(batch)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.4)  # responses 1 and 3: 4 of 10 tokens
    cfg = V.actor_config(rollout_correction=V.preset("bypass_ppo_clip_geo_rs"))
    cfg.global_batch_info.update(batch_num_tokens=10, global_batch_size=4)  # as verl's engine counts them
    v_loss, v_m = V.core_algos.compute_policy_loss_bypass_mode(
        buf.old_log_probs, lp, batch.advantages, base.response_mask, "token-mean", config=cfg)
    assert float(loss.detach()) == pytest.approx(float(v_loss), abs=1e-6)
    key = "rollout_corr/rollout_rs_seq_masked_fraction"
    assert m[key] == pytest.approx(v_m[key])


def _params(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_critic_warmup_updates_only_the_critic_first():
    trainer, _ = make_trainer("algorithm.adv_estimator=gae", "trainer.critic_warmup=1", critic=True)
    buf = hand_batch([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    actor0, critic0 = _params(trainer.actor.module), _params(trainer.critic.module)
    (m1,) = trainer.round(buf, 1)
    actor1, critic1 = _params(trainer.actor.module), _params(trainer.critic.module)
    assert all(torch.equal(actor0[k], actor1[k]) for k in actor0)
    assert any(not torch.equal(critic0[k], critic1[k]) for k in critic0)
    assert m1["training/critic_warmup"] == 1.0 and "actor/pg_loss" not in m1
    (m2,) = trainer.round(buf, 1)
    assert any(not torch.equal(actor1[k], v) for k, v in _params(trainer.actor.module).items())
    assert m2["training/critic_warmup"] == 0.0 and "actor/pg_loss" in m2


def test_shuffle_draws_new_mini_batches_each_epoch():
    trainer, _ = make_trainer("algorithm.adv_estimator=grpo", "actor.shuffle=true")
    buf = hand_batch([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    torch.manual_seed(0)
    orders = [torch.cat([mb.responses[:, 0] for mb in trainer._mini_batches(buf)]).tolist() for _ in range(6)]
    assert all(sorted(o) == [10, 13, 15, 18] for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # the partition changes between epochs
    plain, _ = make_trainer("algorithm.adv_estimator=grpo")
    assert torch.cat([mb.responses[:, 0] for mb in plain._mini_batches(buf)]).tolist() == [10, 13, 15, 18]
