"""Fused CPU kernels for the train step's elementwise passes, compiled by torch's Inductor.

Owns: `install` / `active` (the process-wide switch the trainer sets from
`TrainerConfig.cpu_fused_kernels`; it needs `host.cpp_compiler`), `compiled` (a function
compiled once per process), and the math each kernel computes, written once as plain torch in
a pure function: `norm_forward` / `norm_backward` (RMSNorm, `norm.py`), `swiglu_forward` /
`swiglu_backward` (`swiglu.py`), `rope` (`cpu_compat._Rope`), and `head_stats` / `head_grad`
(one tile of the head's softmax and of its gradient, `lm_head.py`). Each runs through a wrapper
here (`norm`, `norm_grad`, `gated`, `gated_grad`, `rotate`, `tile_stats`, `tile_grad`) that
hands the kernel its inputs flattened and detached. Their callers keep their autograd functions
and call the wrapper when `active()`, the eager code otherwise; the forward-only role always
runs the eager code.

Why: on a CPU a SmolLM2-sized step's norms, gated units, rotary embeddings and head tiles are
chains of small passes over the activations, each reading and writing memory (an eager norm
is about ten of them). Inductor fuses each function into one or two loops of C++ (vectorised,
in fp32 registers), with symbolic token counts so a new micro-batch length does not
recompile; the step ran a quarter faster at best (docs/results/2026-11-29-fused-kernels.md).
What it costs: a C++ compiler at run time, seconds of compiling in each process at its first
step (cached on disk for the next run), and Inductor's modules in the process's memory
(docs/cpu.md#fused-kernels). Compiled in this process (`compile_threads=1`): no pool of
compile workers.

Numerics: each kernel computes in fp32 and rounds once to the output's dtype. The norm's
forward is torch's op for op but for the order of its mean's sum (within one rounding of the
eager one); the gated unit, the rotary embedding and the head's tile gradient round once where
eager rounds after some ops (within a rounding of it; tests/test_fused.py). Must never import
anything from `slime_async` outside `slime_async.trainer` but `host`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from slime_async.host import cpp_compiler

_ACTIVE = False


def install(on: bool) -> None:
    """Switch the fused kernels on or off for this process (`TrainerConfig.cpu_fused_kernels`;
    a CPU trainer only). On without a compiler raises, naming the fix."""
    global _ACTIVE
    if on and cpp_compiler() is None:
        raise RuntimeError(
            "--cpu-fused-kernels needs a C++ compiler (g++ or clang++ on PATH, or CXX) for "
            "torch's Inductor; install one (apt-get install g++) or pass --no-cpu-fused-kernels"
        )
    _ACTIVE = on


def active(x: torch.Tensor) -> bool:
    """Whether `x`'s op runs the fused kernel: switched on, and `x` on the CPU."""
    return _ACTIVE and x.device.type == "cpu"


def norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    """RMSNorm over the last dimension: `(x · r · weight` rounded to x's dtype, `r)` with the
    per-token `r = rsqrt(mean(x²) + eps)` in fp32."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * weight).to(x.dtype), r


def norm_backward(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, g: torch.Tensor) -> tuple:
    """RMSNorm's `(∂x, ∂weight)` from the output gradient `g` (fp32 inside, `n = x · r`):
    `∂x = r · (g·w − n · mean(g·w · n))`, `∂w = Σ_tokens g · n` (in fp32)."""
    n = x.float() * r
    gf = g.float()
    gn = gf * weight
    dot = (gn * n).sum(-1, keepdim=True) / n.shape[-1]
    gw = (gf * n).reshape(-1, g.shape[-1]).sum(0)
    return ((gn - n * dot) * r).to(x.dtype), gw


def swiglu_forward(y: torch.Tensor) -> torch.Tensor:
    """`silu(a) · b` of `y = [a, b]` halved over its last dimension, rounded once."""
    a, b = torch.chunk(y.float(), 2, dim=-1)
    return (F.silu(a) * b).to(y.dtype)


def swiglu_backward(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`[∂a, ∂b]` of `silu(a) · b`: `∂a = g · b · σ(a) · (1 + a · (1 − σ(a)))`, `∂b = g ·
    silu(a)`, in one tensor shaped as `y`."""
    a, b = torch.chunk(y.float(), 2, dim=-1)
    gf = g.float()
    s = torch.sigmoid(a)
    da = gf * b * s * (1 + a * (1 - s))
    # each half rounded before the concatenation: Inductor writes both into the output, with
    # no fp32 `[..., 2f]` buffer between
    return torch.cat([da.to(y.dtype), (gf * a * s).to(y.dtype)], dim=-1)


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adjoint: bool) -> torch.Tensor:
    """RoPE of `t` (`[..., d]`, halves `t₁`, `t₂`; cos/sin broadcast to it) or, `adjoint`, the
    backward's map of a gradient; `cpu_compat._rotate`'s math, rounded once."""
    t1, t2 = t.float().chunk(2, dim=-1)
    c1, c2 = cos.float().chunk(2, dim=-1)
    s1, s2 = sin.float().chunk(2, dim=-1)
    if adjoint:
        out = (t1 * c1 + t2 * s2, t2 * c2 - t1 * s1)
    else:
        out = (t1 * c1 - t2 * s1, t2 * c2 + t1 * s2)
    return torch.cat([half.to(t.dtype) for half in out], dim=-1)


def head_stats(z: torch.Tensor, m: torch.Tensor, t: float) -> tuple:
    """One tile of the head's softmax (`lm_head._softmax_stats`): with `x = z / t` in fp32 and
    `top = max(m, max_row x)` (the running max over the vocabulary blocks so far), `(top,
    Σ e, Σ e·(x − top))` per row, `e = exp(x − top)`: one pass over the tile's logits."""
    x = z.float() / t
    top = torch.maximum(m, x.amax(-1))
    d = x - top[:, None]
    e = torch.exp(d)
    return top, e.sum(-1), (e * d).sum(-1)


def head_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    target: torch.Tensor,
    g_target: torch.Tensor,
    t: float,
) -> torch.Tensor:
    """One tile's `∂/∂z` in the head's backward (`lm_head._ChunkedLogprobs.backward`), rounded
    once to z's dtype: `p·(α + β·log p)` with `log p = z / t − lse`, plus `g_target` in each
    row's `target` column (−1: none in this tile)."""
    logp = z.float() / t - lse[:, None]
    gz = (alpha + logp * beta) * torch.exp(logp)
    cols = torch.arange(z.shape[-1], device=z.device)
    hit = cols[None, :] == target[:, None]
    return torch.where(hit, gz + g_target[:, None], gz).to(z.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    """`norm_forward` compiled, over `x` as `[tokens, hidden]` (one graph for every rank)."""
    out, r = compiled(norm_forward)(_rows(x), weight.detach(), eps)
    return out.view(x.shape), r


def norm_grad(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, g: torch.Tensor) -> tuple:
    """`norm_backward` compiled: `(∂x` shaped as `x`, `∂weight` in fp32`)`."""
    gx, gw = compiled(norm_backward)(_rows(x), r, weight.detach(), _rows(g))
    return gx.view(x.shape), gw


def gated(y: torch.Tensor) -> torch.Tensor:
    """`swiglu_forward` compiled."""
    out = compiled(swiglu_forward)(_rows(y))
    return out.view(*y.shape[:-1], y.shape[-1] // 2)


def gated_grad(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`swiglu_backward` compiled, shaped as `y`."""
    return compiled(swiglu_backward)(_rows(y), _rows(g)).view(y.shape)


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adjoint: bool) -> torch.Tensor:
    """`rope` compiled."""
    return compiled(rope)(t.detach(), cos.detach(), sin.detach(), adjoint)


def tile_stats(z: torch.Tensor, m: torch.Tensor, t: float) -> tuple:
    """`head_stats` compiled."""
    return compiled(head_stats)(z.detach(), m, t)


def tile_grad(*tensors: torch.Tensor, t: float) -> torch.Tensor:
    """`head_grad` compiled, over its tensors in its order (`z, lse, alpha, beta, target,
    g_target`; slices of the step's vectors, detached so that none reaches it as a view)."""
    return compiled(head_grad)(*(a.detach() for a in tensors), t)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[rows, last dimension]`, outside autograd and not a view (Dynamo guards a view's
    base, whose shape changes from call to call): every call has the same rank and no input
    that requires grad, so each kernel compiles once per dtype."""
    return x.reshape(-1, x.shape[-1]).detach()


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`fn` compiled by Inductor (symbolic shapes, in this process), once per process. Where
    torch would not compile a call (its recompile limit) the call runs `fn` eagerly: the same
    math, slower."""
    import torch._inductor.config as inductor

    inductor.compile_threads = 1  # no pool of compile worker processes beside the trainer
    return torch.compile(fn, dynamic=True)
