"""NonFiniteGuard: hooks only where ZeRO 2/3 moves gradients out of `param.grad`, and there they
flag a NaN/inf gradient of any parameter; at ZeRO 0/1 the gradient norm does that job."""

from __future__ import annotations

import math

import torch


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _engine(stage: int):
    from rlhf.config import load_config
    from rlhf.trainer import dist as D
    from rlhf.trainer.engines import build_engine, ds_config

    device = torch.device("cpu")
    D.init_distributed(device)
    cfg = load_config(None, [f"deepspeed.zero_stage={stage}", "trainer.device=cpu"])
    return build_engine(_model(), ds_config(cfg, 1e-3, 0.0, 1.0, 2, device))


def test_guard_on_a_plain_module_flags_inf_and_nan_and_resets():
    from rlhf.trainer.engines import NonFiniteGuard

    model = _model()
    guard = NonFiniteGuard(model)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert not guard.tripped()
    (model(x).sum() * float("inf")).backward()
    assert guard.tripped()
    guard.reset()
    model(x).sum().backward()
    assert not guard.tripped()
    (model(x).sum() * float("nan")).backward()
    assert guard.tripped()


def test_guard_watches_zero2_and_stays_out_of_zero0():
    from rlhf.trainer.engines import NonFiniteGuard, local_grad_norm

    eng0 = _engine(0)
    g0 = NonFiniteGuard(eng0)
    assert g0._handles == [] and not g0.tripped()
    eng0.backward(eng0.module(torch.randn(2, 4)).sum() * float("inf"), scale_wrt_gas=False)
    assert not math.isfinite(local_grad_norm(eng0))  # what skips the step at ZeRO 0/1

    eng2 = _engine(2)
    g2 = NonFiniteGuard(eng2)
    assert len(g2._handles) == len(list(eng2.module.parameters()))
    eng2.backward(eng2.module(torch.randn(2, 4)).sum(), scale_wrt_gas=False)
    assert not g2.tripped() and local_grad_norm(eng2) is None
    eng2.backward(eng2.module(torch.randn(2, 4)).sum() * float("inf"), scale_wrt_gas=False)
    assert g2.tripped()
