"""The language-model head without the full-vocabulary tensor: token log-probs and entropies
straight from the last hidden states and the output weight, one tile of tokens by vocabulary
rows at a time.

Owns: `HiddenOutputLayer` (made by `hidden_output_layer()`; megatron's output
`ColumnParallelLinear`, parameter names unchanged, that hands the model's caller the hidden
states instead of multiplying them out: the model then returns `[b, s, hidden]`), `Logits`
(those hidden states with the weight and TP group they would have been multiplied with),
`tiling` (a tile's tokens and vocabulary rows), `chunked_logprobs` (the custom autograd
function) and `full_logits` (the old `[b, s, V]` tensor, for callers that want logits). Must
never import the controller, engine, rollout or data-worker parts of `slime_async`.

Math, per token with logits `z = h·Wᵀ / T` split over TP ranks by vocabulary (rank r holds
columns `[r·V/TP, (r+1)·V/TP)`; without TP one rank holds all): `m = max z`, `s = Σ exp(z − m)`,
`log p = z − m − log s`, the target's log-prob from the one rank holding its column, entropy
`H = −Σ p log p`. The tokens go in chunks, each chunk's logits in blocks of vocabulary rows
(`tiling`): `m`, `s` and `Σ exp(z − m)·(z − m)` are carried across a rank's blocks and rescaled
when a block raises the max, then combined over TP ranks at the global max (all-reduce MAX,
then SUM). The backward recomputes each tile's logits from the saved hidden states (the
fused-linear-cross-entropy idea): `∂lp/∂z = onehot − p`, `∂H/∂z = −p (log p + H)`, then
`∂h = ∂z·W` summed over the blocks in fp32, `∂W = ∂zᵀ·h`. At most one tile's fp32 logits (and a
few temporaries of that shape) is alive at once, forward or backward. The partial `∂h` of each
TP rank is summed by the region op in front of the head (megatron's, as in
`ColumnParallelLinear`).

The weight's gradient goes straight into megatron's fp32 gradient buffer (`weight.main_grad`,
where DDP's hook would add it), tile by tile, when the weight has one: autograd then gets
none for it, so no `[V/TP, h]` fp32 sum, its cast, or the cast held until the tied embedding's
own gradient joins it (~0.16 GiB at SmolLM2's peak in bf16). Without a buffer (a plain
tensor) the gradient is returned as autograd's. Equal up to float rounding: in bf16 the
tiles' products are summed in fp32 without the round trip through a bf16 gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.distributed as dist

from slime_async.trainer import fused

CHUNK_ELEMENTS = 1 << 20
"""Most logits in one tile on a CPU (4 MiB in fp32: a tile and the few temporaries its softmax
makes stay in a core's cache, where the casts and exponentials run several times faster than
over 16 MiB tiles; docs/results/2026-11-28-small-machine.md)."""
CHUNK_ELEMENTS_GPU = 1 << 26
"""On a GPU (256 MiB of fp32 logits; whole-vocabulary chunks of 1365 tokens at 49k): fewer,
larger kernels."""


TILE_TOKENS = 2048
"""Most tokens per chunk by default on a CPU: a chunk's hidden states meet the vocabulary one
block at a time, so the matmuls keep a large token dimension (85-token whole-vocabulary chunks
ran SmolLM2's at a third of the rate) and the output weight's gradient is added into the fp32
buffer once per chunk, not once per 85 tokens."""
BLOCK_ALIGN = 64
"""Vocabulary rows per block are a multiple of this (the matmuls' tiles)."""

WGRAD_ROWS = 4096
"""Vocabulary rows of the output weight's gradient computed and added into megatron's fp32
buffer at once (`add_weight_grad`)."""


def tiling(
    tokens: int,
    vocab_local: int,
    chunk_tokens: int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[int, int]:
    """(tokens per chunk, vocabulary rows per block) of the head over `tokens` read positions
    and a `vocab_local`-row weight: a tile of at most `CHUNK_ELEMENTS` logits
    (`CHUNK_ELEMENTS_GPU` on a GPU). `chunk_tokens` (`--logits-chunk-tokens`) fixes the chunk;
    unset, a GPU takes whole-vocabulary chunks of `CHUNK_ELEMENTS_GPU // V` tokens and a CPU up
    to `TILE_TOKENS` tokens a chunk, the vocabulary in blocks of what the budget leaves
    (multiples of `BLOCK_ALIGN`)."""
    cpu = torch.device(device).type == "cpu"
    elements = CHUNK_ELEMENTS if cpu else CHUNK_ELEMENTS_GPU
    if chunk_tokens:
        chunk = chunk_tokens
    elif cpu:  # the fewest chunks of at most TILE_TOKENS, evenly split
        chunk = max(1, math.ceil(tokens / max(1, math.ceil(tokens / TILE_TOKENS))))
    else:
        chunk = max(1, elements // max(1, vocab_local))
    block = max(BLOCK_ALIGN, elements // chunk // BLOCK_ALIGN * BLOCK_ALIGN)
    return chunk, min(vocab_local, block)


@functools.cache
def hidden_output_layer() -> type:
    """The `HiddenOutputLayer` class, made on first use: megatron's tensor-parallel layers
    import its optimizer package (and its warnings), which importing this module must not."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class HiddenOutputLayer(ColumnParallelLinear):
        """megatron's output layer, returning the (sequence-gathered) hidden states `[s, b, h]`.

        Installed on a built `GPTModel` by `install` (the instance's class is swapped: no new
        state, the same parameters). Under sequence parallelism the sequence is gathered exactly
        as `ColumnParallelLinear` gathers it (the backward reduce-scatters, summing every rank's
        partial gradient); with TP and no sequence parallelism the backward all-reduces."""

        def forward(  # type: ignore[override]
            self,
            input_: torch.Tensor,
            weight: torch.Tensor | None = None,
            runtime_gather_output: bool | None = None,
        ) -> tuple[torch.Tensor, None]:
            from megatron.core.tensor_parallel.mappings import (
                copy_to_tensor_model_parallel_region,
                gather_from_sequence_parallel_region,
            )

            if self.sequence_parallel:
                h = gather_from_sequence_parallel_region(
                    input_, tensor_parallel_output_grad=True, group=self.tp_group
                )
            elif self.tp_group.size() > 1:
                h = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
            else:
                h = input_
            return h, None

    return HiddenOutputLayer


def install(model: torch.nn.Module) -> None:
    """Make `model` (a last-stage GPTModel) return hidden states instead of logits."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    layer = getattr(model, "output_layer", None)
    if layer is not None and type(layer) is ColumnParallelLinear:
        layer.__class__ = hidden_output_layer()


def returns_hidden(model: torch.nn.Module) -> bool:
    return type(getattr(model, "output_layer", None)) is hidden_output_layer()


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The `[V/TP, h]` weight the output layer multiplies with (the embedding when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def tp_group() -> object | None:
    """The tensor-parallel group, or None with TP = 1."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


@dataclasses.dataclass(frozen=True)
class Logits:
    """What the model's last stage returns, not yet multiplied out: `logits = hidden · weightᵀ`
    (one vocabulary shard per TP rank)."""

    hidden: torch.Tensor
    """`[b, s, h]` hidden states after the final norm (the full sequence)."""
    weight: torch.Tensor
    """`[V/TP, h]` output weight."""
    group: object | None
    """Tensor-parallel group whose ranks hold the other vocabulary shards, or None."""
    chunk_tokens: int | None
    """Tokens per chunk (0: the whole `[tokens, V]` tensor at once, the plain path; None:
    `tiling`'s default)."""

    def full(self) -> torch.Tensor:
        """`[b, s, V]` logits (the full vocabulary, gathered over TP)."""
        return full_logits(self.hidden, self.weight, self.group)


def full_logits(hidden: torch.Tensor, weight: torch.Tensor, group: object | None) -> torch.Tensor:
    """`[..., V]` logits of `[..., h]` hidden states (gathering the vocabulary over `group`)."""
    z = hidden.to(weight.dtype) @ weight.t()
    if group is None:
        return z
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(z)


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: object | None) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


def _shard(targets: torch.Tensor, v_local: int, group: object | None) -> tuple:
    """(this rank's local column of each target, whether this rank holds it)."""
    start = 0 if group is None else dist.get_rank(group) * v_local
    held = (targets >= start) & (targets < start + v_local)
    return (targets - start).clamp(0, v_local - 1), held


def _in_block(col: torch.Tensor, held: torch.Tensor, r: int, rows: int) -> torch.Tensor:
    """Which of a chunk's targets this rank holds in its vocabulary rows `[r, r + rows)`."""
    return held & (col >= r) & (col < r + rows)


def _softmax_stats(
    h: torch.Tensor,
    weight: torch.Tensor,
    col: torch.Tensor,
    held: torch.Tensor,
    temperature: float,
    block: int,
    group: object | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target log-prob `[c]`, entropy `[c]`, `m + log s` `[c]`) of one chunk's logits
    `z = h·Wᵀ / T`, `block` vocabulary rows at a time: per row the running max `m`, `s = Σ e`
    and `a = Σ e·(z − m)` with `e = exp(z − m)` (rescaled by `exp(m − m')` when a block raises the
    max to `m'`: `s ← s·f`, `a ← f·(a + s·(m − m'))`), the target's raw logit from the block
    holding it. Entropy `log s − a / s`: one exponential pass, no `[c, V]` tensor. Over TP ranks
    the three are combined the same way at the global max (all-reduce MAX, then SUM)."""
    v, h = weight.shape[0], h.to(weight.dtype)
    m = s = a = None
    zt = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
    fast = fused.active(h)  # each tile's pass in one compiled kernel (fused.head_stats)
    for r in range(0, v, block):
        w = weight[r : r + block]
        z = h @ w.t()
        inb = _in_block(col, held, r, w.shape[0])
        at = (col - r).clamp(0, w.shape[0] - 1)[:, None]
        if fast:
            zt = torch.where(inb, z.gather(-1, at)[:, 0].float() / temperature, zt)
            if m is None:
                m, s, a = fused.tile_stats(z, torch.full_like(zt, -math.inf), temperature)
            else:
                top, s_b, a_b = fused.tile_stats(z, m, temperature)
                f = (m - top).exp_()
                a = a.add_(s * (m - top)).mul_(f).add_(a_b)
                s, m = s.mul_(f).add_(s_b), top
            continue
        z = z if temperature == 1.0 else z.float().div_(temperature)
        zt = torch.where(inb, z.gather(-1, at)[:, 0].float(), zt)
        mb = z.amax(-1).float()
        if m is None:
            m, s, a = mb, torch.zeros_like(mb), torch.zeros_like(mb)
        else:
            top = torch.maximum(m, mb)
            f = (m - top).exp_()
            a = a.add_(s * (m - top)).mul_(f)
            s, m = s.mul_(f), top
        shifted = z.float().sub_(m[:, None])  # a fresh copy when z is not fp32 (then in place)
        e = shifted.exp()
        s.add_(e.sum(-1))
        a.add_(torch.linalg.vecdot(e, shifted))
    if group is not None:  # the global max, and every rank's sums rescaled to it
        top = m.clone()
        _all_reduce(top, dist.ReduceOp.MAX, group)
        f = (m - top).exp_()
        sums = torch.stack([s * f, a.add_(s * (m - top)).mul_(f), zt])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        m, s, a, zt = top, sums[0], sums[1], sums[2]
    log_s = s.log()
    return zt.sub_(m).sub_(log_s), log_s - a / s, m + log_s


def add_weight_grad(main: torch.Tensor, gz: torch.Tensor, h_t: torch.Tensor) -> None:
    """`main += gzᵀ·h` (`main` `[rows, h]` fp32, `gz` `[n, rows]` in the weight's dtype, `h_t`
    `[h, n]` contiguous: the chunk's hidden states transposed once), `WGRAD_ROWS` vocabulary
    rows at a time. The product is taken as `h_t · gz` (both operands row-major: on a CPU twice
    the rate of `gzᵀ · h`, which reads its left operand transposed) and added transposed. Alive
    at once is one block's product and its fp32 cast, not a whole `[V, h]` product and the fp32
    copy a mixed-dtype add makes of it (~0.16 GiB at SmolLM2's shapes in bf16)."""
    for r in range(0, main.shape[0], WGRAD_ROWS):
        main[r : r + WGRAD_ROWS].add_((h_t @ gz[:, r : r + WGRAD_ROWS]).t())


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: object,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        block: int,
        group: object | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        col, held = _shard(targets, weight.shape[0], group)
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            lp[s:e], ent[s:e], lse[s:e] = _softmax_stats(
                hidden[s:e], weight, col[s:e], held[s:e], temperature, block, group
            )
        ctx.save_for_backward(hidden, weight, col, held, ent, lse)
        ctx.temperature, ctx.chunk, ctx.block = temperature, chunk, block
        ctx.main_grad = getattr(weight, "main_grad", None)
        return lp, ent

    @staticmethod
    def backward(ctx: object, g_lp: torch.Tensor, g_ent: torch.Tensor) -> tuple:  # type: ignore[override]
        hidden, weight, col, held, ent, lse = ctx.saved_tensors
        t, chunk, block = ctx.temperature, ctx.chunk, ctx.block
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        v = weight.shape[0]
        g_h = torch.empty_like(hidden) if want_h else None
        main = ctx.main_grad if want_w else None  # megatron's fp32 gradient buffer: added to
        g_w = None
        if want_w and main is None:
            g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        alpha = (g_lp + g_ent * ent).div_(-t)[:, None]
        beta = (g_ent / -t)[:, None]
        fast = fused.active(hidden)
        g_t = g_lp / t if fast else None  # the target's own term of ∂/∂z
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            h = hidden[s:e].to(weight.dtype)
            h_t = h.t().contiguous() if want_w else None
            acc = None  # fp32 ∂h of the chunk, summed over the vocabulary blocks
            for r in range(0, v, block):
                w = weight[r : r + block]
                z = h @ w.t()
                inb = _in_block(col[s:e], held[s:e], r, w.shape[0])
                if fast:  # the eager lines below in one compiled kernel (fused.head_grad)
                    target = torch.where(inb, col[s:e] - r, -1)
                    gz = fused.tile_grad(z, lse[s:e], alpha[s:e], beta[s:e], target, g_t[s:e], t=t)
                else:
                    logp = z.float() if t == 1.0 else z.float().div_(t)
                    logp = logp.sub_(lse[s:e, None])
                    p = logp.exp()
                    # ∂/∂z = p·(α + β·log p) + g_lp·onehot, all / T, with α = −(g_lp + g_ent·H)
                    # and β = −g_ent per token; in place on log p
                    gz = torch.addcmul(alpha[s:e], logp, beta[s:e], out=logp).mul_(p)
                    rows = inb.nonzero().squeeze(-1)
                    gz[rows, col[s:e][rows] - r] += g_lp[s:e][rows] / t
                    gz = gz.to(weight.dtype)
                if g_h is not None:
                    part = gz @ w
                    acc = part.float() if acc is None else acc.add_(part)
                if want_w:  # in the weight's dtype (bf16 matmuls), summed in fp32
                    into = main if main is not None else g_w
                    add_weight_grad(into[r : r + block], gz, h_t)
            if acc is not None:
                g_h[s:e] = acc.to(hidden.dtype)
        if main is not None:  # in the buffer already: no [V, h] gradient for autograd to hold
            return g_h, None, None, None, None, None, None
        return g_h, None if g_w is None else g_w.to(weight.dtype), None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    vocab_block: int | None = None,
    group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs `[N]`, entropies `[N]`) fp32 of `targets` `[N]` under
    `softmax(hidden · weightᵀ / temperature)` for `hidden` `[N, h]` and this rank's vocabulary
    shard `weight` `[V/TP, h]` (`group`: the TP group, None for the whole vocabulary).
    Differentiable in `hidden` and `weight`; `chunk_tokens` tokens by `vocab_block` vocabulary
    rows at a time (defaults: `tiling`)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, h] and targets [N], got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    chunk, block = tiling(hidden.shape[0], weight.shape[0], chunk_tokens, weight.device)
    return _ChunkedLogprobs.apply(
        hidden,
        weight,
        targets.to(hidden.device).long(),
        float(temperature),
        chunk,
        min(weight.shape[0], vocab_block or block),
        group,
    )
