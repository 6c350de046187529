"""MasterAdamW (float32 masters of bf16 parameters) and the engine that runs it at ZeRO stage 0."""

from __future__ import annotations

import pytest
import torch

from rlhf.trainer.master_adam import MasterAdamW


def _model(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _grads(model, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def test_step_is_float32_adamw_on_the_masters_with_clipping():
    model = _model()
    ref = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = MasterAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(3):
        _grads(model, seed=step, scale=3.0)
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=True)
        ref_opt.step()
        opt.step()
        assert torch.allclose(opt._global_grad_norm, norm)
    for m, r, p in zip(opt.masters, ref, model.parameters()):
        assert torch.allclose(m, r, rtol=1e-6, atol=1e-7)
        assert torch.equal(p, r.to(torch.bfloat16))  # the model holds the masters' bf16 rounding
        assert p.grad is not None and m.grad is None  # the model's grads are the engine's to clear


def test_updates_below_bf16_resolution_accumulate_in_the_masters():
    """lr 1e-5 moves a weight of ~0.3 by far less than bf16's spacing there (~2e-3): a bf16-only
    AdamW loses every update; the masters keep them until the bf16 weights move."""
    model = _model(dtype=torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    opt = MasterAdamW(model.parameters(), lr=1e-5)
    bf16_only = _model(dtype=torch.bfloat16)
    plain = torch.optim.AdamW(bf16_only.parameters(), lr=1e-5, foreach=True)
    for _ in range(300):
        _grads(model, seed=7)
        _grads(bf16_only, seed=7)
        opt.step()
        plain.step()
    moved = sum(int((p != s).sum()) for p, s in zip(model.parameters(), start))
    moved_plain = sum(int((p != s).sum()) for p, s in zip(bf16_only.parameters(), start))
    total = sum(p.numel() for p in model.parameters())
    assert moved > 0.5 * total, (moved, total)
    assert moved_plain < moved / 4, (moved_plain, moved)


def test_state_dict_round_trip_restores_the_float32_masters():
    model = _model()
    opt = MasterAdamW(model.parameters(), lr=1e-3)
    _grads(model)
    opt.step()
    sd = opt.state_dict()
    other = _model(seed=5)
    opt2 = MasterAdamW(other.parameters(), lr=1e-3)
    opt2.load_state_dict(sd)
    for a, b in zip(opt.masters, opt2.masters):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(sd["state"][0]["exp_avg"])
    del sd["master_params"]
    with pytest.raises(KeyError, match="master_params"):
        opt2.load_state_dict(sd)


def test_bf16_engine_at_stage_0_runs_master_adam_and_resumes_exactly(tmp_path):
    """The DeepSpeed engine built for bf16 at ZeRO 0 steps with MasterAdamW, skips the one-rank
    all-reduce, and a checkpoint reload gives back the float32 masters, not their bf16 rounding."""
    from rlhf.config import load_config
    from rlhf.trainer import dist as D
    from rlhf.trainer.engines import build_engine, ds_config

    device = torch.device("cpu")
    D.init_distributed(device)
    cfg = load_config(None, ["deepspeed.bf16=true", "deepspeed.zero_stage=0", "trainer.device=cpu"])

    def engine(seed):
        return build_engine(_model(seed), ds_config(cfg, 1e-3, 0.0, 1.0, 4, device))

    eng = engine(0)
    assert isinstance(eng.optimizer, MasterAdamW) and not eng.enable_backward_allreduce
    assert eng.communication_data_type == torch.bfloat16  # gradients reduced in bf16, not cast to float32
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for _ in range(2):
        eng.backward(eng.module(x).float().pow(2).mean(), scale_wrt_gas=False)
        eng.step()
    assert all(p.grad is None for p in eng.module.parameters())
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in eng.optimizer.masters)
    eng.save_checkpoint(str(tmp_path), tag="t")
    back = engine(3)
    back.load_checkpoint(str(tmp_path), tag="t", load_lr_scheduler_states=False)
    for a, b in zip(eng.optimizer.masters, back.optimizer.masters):
        assert torch.equal(a, b)
    for a, b in zip(eng.module.parameters(), back.module.parameters()):
        assert torch.equal(a, b)
