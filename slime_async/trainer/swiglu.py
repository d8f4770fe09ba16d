"""SwiGLU in one autograd function: megatron's gated MLP activation without its concatenation.

Owns: `swiglu` (an autograd function over the first linear's `[..., 2f]` output) and `install`,
which makes every plain megatron `MLP` of a built model with a SwiGLU unit use it (the
instance's class is swapped: same submodules, same parameter names). The forward is megatron's
unfused `glu` op for op (`silu(a) · b` in the compute dtype, `a` and `b` the two halves): the
output is bitwise megatron's. The backward is autograd's arithmetic too, `∂b = g · silu(a)` and
`∂a = silu'(a) · (g · b)` (torch's `silu_backward`), so the gradients are bitwise as well; what
changes is where they go and what is kept:

* both halves are written into one `[..., 2f]` gradient (`out=` views), where autograd's chain
  ends in a `torch.cat` of them (about a tenth of a CPU step's non-matmul time at SmolLM2's
  shapes, docs/results/2026-11-28-small-machine.md);
* megatron adds `glu_linear_offset` (0.0) to `b` before the product, a fresh `[..., f]` copy
  that autograd keeps until the backward: no copy here, the unit's input and `silu(a)` are
  what is kept (3·f values a token instead of 4·f).

With `--cpu-fused-kernels` a CPU unit runs `fused.gated` / `fused.gated_grad` instead (one
rounding, within one of megatron's; it keeps its input alone).

Only where megatron would run that unfused path: `gated_linear_unit` with `F.silu`, no
activation fusion, TransformerEngine activation, clamp or offset; a call with
`per_token_scale` (MoE experts weighting their output) goes to megatron's own forward. Must
never import anything from `slime_async` outside `slime_async.trainer` (and `host`, which
`fused` reads the compiler from).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from slime_async.trainer import fused


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.fused = fused.active(y)  # the backward follows the forward
        if ctx.fused:
            ctx.save_for_backward(y)
            return fused.gated(y)
        a, b = torch.chunk(y, 2, dim=-1)
        s = F.silu(a)
        ctx.save_for_backward(y, s)
        return s * b

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if ctx.fused:
            (y,) = ctx.saved_tensors
            return fused.gated_grad(y, g)
        y, s = ctx.saved_tensors
        a, b = torch.chunk(y, 2, dim=-1)
        dy = torch.empty_like(y)
        da, db = torch.chunk(dy, 2, dim=-1)
        torch.mul(g, s, out=db)
        torch.ops.aten.silu_backward.grad_input(g * b, a, grad_input=da)
        return dy


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """`silu(a) · b` of `y = [a, b]` split in halves over its last dimension (see the module
    docstring)."""
    return _SwiGLU.apply(y)


@functools.cache
def swiglu_mlp() -> type:
    """The `SwiGLUMLP` class, made on first use (megatron imported then, not at this import)."""
    from megatron.core.transformer.mlp import MLP

    class SwiGLUMLP(MLP):
        """megatron's `MLP` whose gated unit is `swiglu` (installed by `install`)."""

        def forward(  # type: ignore[override]
            self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kw
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            if per_token_scale is not None:
                return super().forward(hidden_states, per_token_scale, **kw)
            y, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                y = y + bias
            return self.linear_fc2(swiglu(y))

    return SwiGLUMLP


def applies(config: object) -> bool:
    """Whether megatron would run `silu(a) · (b + 0)` unfused for this TransformerConfig."""
    return (
        bool(config.gated_linear_unit)
        and config.activation_func is F.silu
        and not config.bias_activation_fusion
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and getattr(config, "glu_linear_offset", 0.0) == 0.0
    )


def install(model: torch.nn.Module) -> int:
    """Swap every plain megatron `MLP` of `model` whose config `applies` to `SwiGLUMLP`;
    returns how many."""
    from megatron.core.transformer.mlp import MLP

    count = 0
    for mod in model.modules():
        if type(mod) is MLP and applies(mod.config):
            mod.__class__ = swiglu_mlp()
            count += 1
    return count
