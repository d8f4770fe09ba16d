"""RMSNorm with a hand-written backward for the CPU trainer.

Owns: `rms_norm` (an autograd function) and `install`, which makes every `torch.nn.RMSNorm` of a
built model use it (the instance's class is swapped: same parameters, same names). The forward
is torch's own CPU math op for op (`x` in fp32, `x · rsqrt(mean(x²) + eps)` times the
weight in fp32, rounded once to `x`'s dtype), so outputs are bitwise torch's. The backward
keeps only `x` and the per-token `rsqrt` (autograd kept the fp32 input, its square and the
normalised values) and computes, in fp32 per token with `n = x · r`,
`∂x = r · (g·w − n · mean(g·w · n))` and `∂w = Σ_tokens g · n`: fewer passes over the
activations than autograd's chain of small ops, which on a CPU cost about as much as a layer's
matmuls at small hidden sizes. With `--cpu-fused-kernels` both directions run `fused.norm` /
`fused.norm_grad` instead (the same math compiled by Inductor, within a rounding; a forward and
its backward always take the same path). Must never import anything from `slime_async` outside
`slime_async.trainer` (and `host`, which `fused` reads the compiler from).
"""

from __future__ import annotations

import torch

from slime_async.trainer import fused


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, weight: torch.Tensor | None, eps: float):  # type: ignore[override]
        ctx.fused = weight is not None and fused.active(x)  # the backward follows the forward
        if ctx.fused:
            out, r = fused.norm(x, weight, eps)
            ctx.save_for_backward(x, r, weight)
            return out
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        n = xf * r if xf is x else xf.mul_(r)  # never overwrite an fp32 input
        if weight is not None:
            n.mul_(weight)  # in fp32, as torch's CPU kernel does, then one rounding
        ctx.save_for_backward(x, r, weight)
        return n.to(x.dtype)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple:  # type: ignore[override]
        x, r, weight = ctx.saved_tensors
        if ctx.fused:
            gx, gw = fused.norm_grad(x, r, weight, g)
            return gx, gw.to(weight.dtype) if ctx.needs_input_grad[1] else None, None
        n = x.to(torch.float32, copy=True).mul_(r)  # the fp32 normalised input
        gf = g.float()
        gw = None
        if weight is not None and ctx.needs_input_grad[1]:
            gw = (gf * n).reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
        gn = gf if weight is None else (gf * weight if gf is g else gf.mul_(weight))
        dot = torch.linalg.vecdot(gn, n).unsqueeze(-1).div_(n.shape[-1])
        gx = torch.addcmul(gn, n, dot, value=-1.0, out=n).mul_(r).to(x.dtype)  # r·(gn − n·dot)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension (see the module docstring)."""
    return _RMSNorm.apply(x, weight, eps)


class FastRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` through `rms_norm` (installed by `install`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, self.weight, eps)


def install(model: torch.nn.Module) -> int:
    """Swap every `torch.nn.RMSNorm` of `model` over its last dimension to `FastRMSNorm`;
    returns how many."""
    count = 0
    for mod in model.modules():
        if type(mod) is torch.nn.RMSNorm and len(mod.normalized_shape) == 1:
            mod.__class__ = FastRMSNorm
            count += 1
    return count
