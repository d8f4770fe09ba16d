"""RMSNorm with its own backward (`slime_async/trainer/norm.py`) against `torch.nn.RMSNorm`:
the forward bitwise, the gradients to rounding, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)], ids=["fp32", "bf16"]
)
def test_rms_norm_is_torchs_forward_bitwise_and_its_gradients(dtype, tol):
    from slime_async.trainer.norm import FastRMSNorm, install

    g = torch.Generator().manual_seed(0)
    x0 = (torch.randn(37, 2, 96, generator=g) * 3).to(dtype)
    grad = torch.randn(x0.shape, generator=g).to(dtype)
    ref = torch.nn.RMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(96, generator=g) * 0.5 + 1)
    ours = torch.nn.Sequential(torch.nn.RMSNorm(96, eps=1e-5).to(dtype))
    ours[0].load_state_dict(ref.state_dict())
    assert install(ours) == 1 and type(ours[0]) is FastRMSNorm
    assert [n for n, _ in ours.named_parameters()] == ["0.weight"]  # names unchanged

    outs = []
    for mod in (ref, ours):
        x = x0.clone().requires_grad_()
        y = mod(x)
        y.backward(grad)
        assert torch.equal(x.detach(), x0)  # the input is never overwritten
        weight = next(mod.parameters())
        outs.append((y.detach(), x.grad, weight.grad))
    (y_r, gx_r, gw_r), (y_o, gx_o, gw_o) = outs
    assert torch.equal(y_o, y_r)
    for got, want in ((gx_o, gx_r), (gw_o, gw_r)):
        assert got.dtype == want.dtype
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert err <= tol, err
