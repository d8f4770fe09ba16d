"""SwiGLU in one autograd function (`slime_async/trainer/swiglu.py`) against megatron's unfused
gated unit: the output and every gradient bitwise, alone and in a trained model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.timeout(120)


def _megatron_glu(y: torch.Tensor) -> torch.Tensor:
    """megatron-core 0.16's unfused `glu` with its default `glu_linear_offset` (0.0)."""
    a, b = torch.chunk(y, 2, dim=-1)
    return F.silu(a) * (b + 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_is_megatrons_unit_bitwise(dtype):
    from slime_async.trainer.swiglu import swiglu

    g = torch.Generator().manual_seed(0)
    y0 = (torch.randn(23, 2, 2 * 48, generator=g) * 3).to(dtype)
    grad = torch.randn(23, 2, 48, generator=g).to(dtype)
    outs = []
    for fn in (_megatron_glu, swiglu):
        y = y0.clone().requires_grad_()
        out = fn(y)
        out.backward(grad)
        assert torch.equal(y.detach(), y0)
        outs.append((out.detach(), y.grad))
    (out_m, dy_m), (out_s, dy_s) = outs
    assert out_s.dtype == dtype and dy_s.dtype == dtype
    assert torch.equal(out_s, out_m)
    assert torch.equal(dy_s, dy_m)


def test_only_the_unit_megatron_runs_unfused_is_replaced():
    from types import SimpleNamespace

    from slime_async.trainer.swiglu import applies

    base = dict(
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        use_te_activation_func=False,
        activation_func_clamp_value=None,
        glu_linear_offset=0.0,
    )
    assert applies(SimpleNamespace(**base))
    for change in (
        {"gated_linear_unit": False},
        {"activation_func": F.gelu},
        {"bias_activation_fusion": True},
        {"use_te_activation_func": True},
        {"activation_func_clamp_value": 7.0},
        {"glu_linear_offset": 1.0},
    ):
        assert not applies(SimpleNamespace(**{**base, **change})), change


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_trained_model_gets_megatrons_gradients_bitwise(bf16, monkeypatch):
    """A train step of a small dense model with the unit installed and with megatron's own MLP
    (install turned off): the same log-probs and the same fp32 gradient buffers, bit for bit."""
    from slime_async.contracts.model import ModelSpec
    from slime_async.trainer import swiglu
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    spec = ModelSpec(family="qwen3", num_layers=2)
    batch = random_batch(spec, batch=4, width=14, prompt=4, seed=0)
    results = []
    for installed in (True, False):
        if not installed:
            monkeypatch.setattr(swiglu, "install", lambda model: 0)
        tr = MegatronTrainer(TrainerConfig(lr=1e-2, micro_batch_size=2, seed=3, bf16=bf16), spec)
        mlps = [m for m in tr.model.modules() if type(m).__name__ == "SwiGLUMLP"]
        assert len(mlps) == (spec.num_layers if installed else 0)
        lp, _ = tr.compute_logprobs(batch)
        tr.train_step(batch)
        grads = {n: p.main_grad.detach().clone() for n, p in tr.model.named_parameters()}
        results.append((lp, grads))
    (lp_s, g_s), (lp_m, g_m) = results
    assert torch.equal(lp_s, lp_m)
    assert g_s.keys() == g_m.keys()
    for n in g_m:
        assert torch.equal(g_s[n], g_m[n]), n
