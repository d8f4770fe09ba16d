"""The language-model head without the full-vocabulary tensor: token log-probs and entropies
straight from the last hidden states and the output weight, a chunk of tokens at a time.

Owns: `HiddenOutputLayer` (made by `hidden_output_layer()`; megatron's output `ColumnParallelLinear`, parameter names unchanged,
that hands the model's caller the hidden states instead of multiplying them out: the model
then returns `[b, s, hidden]`), `Logits` (those hidden states with the weight and TP group they
would have been multiplied with), `chunked_logprobs` (the custom autograd function) and
`full_logits` (the old `[b, s, V]` tensor, for callers that want logits). Must never import the
controller, engine, rollout or data-worker parts of `slime_async`.

Math, per token with logits `z = h·Wᵀ / T` split over TP ranks by vocabulary (rank r holds
columns `[r·V/TP, (r+1)·V/TP)`; without TP one rank holds all): `m = max z` (all-reduce MAX),
`s = Σ exp(z − m)` (all-reduce SUM), `log p = z − m − log s`, the target's log-prob summed from
the one rank holding its column, entropy `H = −Σ p log p` (all-reduce SUM). The backward
recomputes each chunk's logits from the saved hidden states (the fused-linear-cross-entropy
idea): `∂lp/∂z = onehot − p`, `∂H/∂z = −p (log p + H)`, then `∂h = ∂z·W`, `∂W = ∂zᵀ·h`. At most one
chunk's `[chunk, V/TP]` fp32 logits (and a few temporaries of that shape) is alive at once,
forward or backward. The partial `∂h` of each TP rank is summed by the region op in front of
the head (megatron's, as in `ColumnParallelLinear`).

The weight's gradient goes straight into megatron's fp32 gradient buffer (`weight.main_grad`,
where DDP's hook would add it), chunk by chunk, when the weight has one: autograd then gets
none for it, so no `[V/TP, h]` fp32 sum, its cast, or the cast held until the tied embedding's
own gradient joins it (~0.16 GiB at SmolLM2's peak in bf16). Without a buffer (a plain
tensor) the gradient is returned as autograd's. Equal up to float rounding: in bf16 the
chunks' products are summed in fp32 without the round trip through a bf16 gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 22
"""Default logits elements per chunk on a CPU (16 MiB of fp32 logits; 85 tokens at a 49k
vocabulary: the matmuls stay large, and the chunk's few fp32 temporaries are what the trainer's
peak holds above its activations; halving it from 32 MiB lowered a SmolLM2 step's peak at
no cost in time, docs/results/2026-11-28-small-machine.md)."""
CHUNK_ELEMENTS_GPU = 1 << 26
"""On a GPU (256 MiB of fp32 logits; 1365 tokens at 49k): fewer, larger kernels."""


WGRAD_ROWS = 4096
"""Vocabulary rows of the output weight's gradient computed and added into megatron's fp32
buffer at once (`add_weight_grad`)."""


def default_chunk_tokens(vocab_local: int, device: torch.device | str = "cpu") -> int:
    """Tokens per chunk when `--logits-chunk-tokens` is unset: `CHUNK_ELEMENTS` logits
    (`CHUNK_ELEMENTS_GPU` on a GPU)."""
    elements = CHUNK_ELEMENTS if torch.device(device).type == "cpu" else CHUNK_ELEMENTS_GPU
    return max(1, elements // max(1, vocab_local))


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
    chunk_tokens: int
    """Tokens per chunk (0: the whole `[tokens, V]` tensor at once, the plain path)."""

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


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 `[c, V/TP]` logits / temperature of one chunk (a fresh tensor the caller may
    overwrite: the softmax below works in place on it)."""
    z = (h.to(weight.dtype) @ weight.t()).float()
    return z if temperature == 1.0 else z.div_(temperature)


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: object | None) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


def _shard(targets: torch.Tensor, v_local: int, group: object | None) -> tuple:
    """(this rank's local column of each target, whether this rank holds it)."""
    start = 0 if group is None else dist.get_rank(group) * v_local
    held = (targets >= start) & (targets < start + v_local)
    return (targets - start).clamp(0, v_local - 1), held


def _softmax_stats(
    z: torch.Tensor, col: torch.Tensor, held: torch.Tensor, group: object | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target log-prob `[c]`, entropy `[c]`, `m + log s` `[c]`) of the logits `z` `[c, V/TP]`
    (overwritten with `z − m`). Entropy as `log s − Σ e·(z − m) / s` with `e = exp(z − m)`:
    one exponential pass, no `[c, V/TP]` log-prob tensor."""
    m = z.max(-1).values
    _all_reduce(m, dist.ReduceOp.MAX, group)
    shifted = z.sub_(m[:, None])
    e = shifted.exp()
    sums = torch.stack(
        [
            e.sum(-1),
            torch.linalg.vecdot(e, shifted),
            torch.where(held, shifted.gather(-1, col[:, None]).squeeze(-1), 0.0),
        ]
    )
    _all_reduce(sums, dist.ReduceOp.SUM, group)
    log_s = sums[0].log()
    return sums[2] - log_s, log_s - sums[1] / sums[0], m + log_s


def add_weight_grad(main: torch.Tensor, gz: torch.Tensor, h: torch.Tensor) -> None:
    """`main += gzᵀ·h` (`main` `[V, h]` fp32, `gz` `[n, V]` and `h` `[n, h]` in the weight's
    dtype), `WGRAD_ROWS` vocabulary rows at a time: alive at once is one block's product and its
    fp32 cast, not a whole `[V, h]` product and the fp32 copy a mixed-dtype add makes of it
    (~0.16 GiB at SmolLM2's shapes in bf16)."""
    for r in range(0, main.shape[0], WGRAD_ROWS):
        main[r : r + WGRAD_ROWS].add_(gz[:, r : r + WGRAD_ROWS].t() @ h)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: object,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        group: object | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        col, held = _shard(targets, weight.shape[0], group)
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent, lse = torch.empty_like(lp), torch.empty_like(lp)
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk], weight, temperature)
            lp[s : s + chunk], ent[s : s + chunk], lse[s : s + chunk] = _softmax_stats(
                z, col[s : s + chunk], held[s : s + chunk], group
            )
        ctx.save_for_backward(hidden, weight, col, held, ent, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.main_grad = getattr(weight, "main_grad", None)
        return lp, ent

    @staticmethod
    def backward(ctx: object, g_lp: torch.Tensor, g_ent: torch.Tensor) -> tuple:  # type: ignore[override]
        hidden, weight, col, held, ent, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(hidden) if want_h else None
        g_w = None  # fp32; the first chunk's product initialises it (no zero-filled pass)
        main = ctx.main_grad if want_w else None  # megatron's fp32 gradient buffer: added to
        for s in range(0, hidden.shape[0], chunk):
            e = min(s + chunk, hidden.shape[0])
            h = hidden[s:e]
            logp = _chunk_logits(h, weight, t).sub_(lse[s:e, None])
            p = logp.exp()
            # ∂/∂z = −p·(g_lp + g_ent·(log p + H)) + g_lp·onehot, all / T; in place on log p
            gz = logp.add_(ent[s:e, None]).mul_(g_ent[s:e, None]).add_(g_lp[s:e, None])
            gz = gz.mul_(p).neg_()
            rows = held[s:e].nonzero().squeeze(-1)
            gz[rows, col[s:e][rows]] += g_lp[s:e][rows]
            if t != 1.0:
                gz.div_(t)
            gz = gz.to(weight.dtype)
            if g_h is not None:
                g_h[s:e] = (gz @ weight).to(hidden.dtype)
            if want_w and main is not None:  # in the weight's dtype (bf16 matmuls), in fp32
                add_weight_grad(main, gz, h.to(weight.dtype))
            elif want_w:
                part = gz.t() @ h.to(weight.dtype)
                g_w = part.float() if g_w is None else g_w.add_(part)
        if main is not None:  # in the buffer already: no [V, h] gradient for autograd to hold
            return g_h, None, None, None, None, None
        if want_w and g_w is None:  # no tokens
            g_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return g_h, None if g_w is None else g_w.to(weight.dtype), None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs `[N]`, entropies `[N]`) fp32 of `targets` `[N]` under
    `softmax(hidden · weightᵀ / temperature)` for `hidden` `[N, h]` and this rank's vocabulary
    shard `weight` `[V/TP, h]` (`group`: the TP group, None for the whole vocabulary).
    Differentiable in `hidden` and `weight`; `chunk_tokens` tokens at a time (default
    `default_chunk_tokens`)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"expected hidden [N, h] and targets [N], got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], weight.device)
    return _ChunkedLogprobs.apply(
        hidden, weight, targets.to(hidden.device).long(), float(temperature), chunk, group
    )
