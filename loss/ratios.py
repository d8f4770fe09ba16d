"""Log-space, NaN/-inf-safe importance ratios and sequence (segment) helpers.

Owns: `safe_log_ratio`, `safe_ratio`, and the segment helpers that map per-token tensors,
padded `[B, T]` or packed `[N]` + `cu_seqlens`, to per-sequence sums and back.
Pure tensor functions; must never import `slime_async`.
"""

from __future__ import annotations

import torch

from loss.types import upcast


def safe_log_ratio(
    num_logprobs: torch.Tensor,
    den_logprobs: torch.Tensor,
    *,
    clamp: float = 20.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Δ = clamp(num − den, −clamp, clamp) with non-finite Δ (−inf − −inf = NaN, ±inf) set to 0.

    bf16/fp16 inputs are upcast to fp32 *before* subtracting. Gradient flows to whichever input
    requires it (zero at positions whose Δ was non-finite). Shapes: any, equal.
    """
    a, b = upcast(num_logprobs), upcast(den_logprobs)
    if dtype is not None:
        a, b = a.to(dtype), b.to(dtype)
    d = a - b
    if d.requires_grad:
        return torch.nan_to_num(d, nan=0.0, posinf=0.0, neginf=0.0).clamp(-clamp, clamp)
    return d.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).clamp_(-clamp, clamp)


def safe_ratio(
    num_logprobs: torch.Tensor,
    den_logprobs: torch.Tensor,
    *,
    clamp: float = 20.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """exp(`safe_log_ratio`): finite, in [e^−clamp, e^clamp]."""
    return safe_log_ratio(num_logprobs, den_logprobs, clamp=clamp, dtype=dtype).exp()


def num_seqs(shape_ref: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    """Number of sequences: B for padded `[B, T]`, len(cu_seqlens) − 1 for packed."""
    return shape_ref.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


def segment_ids(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """Sequence index of each of the `n` packed positions; trailing positions past
    `cu_seqlens[-1]` get index B (a spill bucket callers drop). Shape `[n]`, int64."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()) or int(cu[-1]) > n:
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at <= N={n}; got "
            f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}."
        )
    b = lengths.numel()
    ids = torch.repeat_interleave(torch.arange(b, dtype=torch.int64), lengths)
    if ids.numel() < n:
        ids = torch.cat([ids, torch.full((n - ids.numel(),), b, dtype=torch.int64)])
    return ids.to(cu_seqlens.device)


def seq_sum(
    x: torch.Tensor, cu_seqlens: torch.Tensor | None, *, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sequence sums of a per-token tensor (already masked by the caller).

    Padded `[B, T, *rest]` → `[B, *rest]`; packed `[N, *rest]` → `[B, *rest]`. Differentiable.
    """
    if cu_seqlens is None:
        return x.sum(dim=1)
    b = cu_seqlens.numel() - 1
    if ids is None:
        ids = segment_ids(cu_seqlens, x.shape[0])
    out = torch.zeros((b + 1, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out.index_add(0, ids, x)[:b]


def broadcast_seq(
    values: torch.Tensor,
    like: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    *,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence values `[B]` → per-token tensor shaped like `like` (`[B, T]` or `[N]`).

    Packed trailing positions (past `cu_seqlens[-1]`) get 0.
    """
    if cu_seqlens is None:
        return values.unsqueeze(-1).expand_as(like)
    if ids is None:
        ids = segment_ids(cu_seqlens, like.shape[0])
    padded = torch.cat([values, values.new_zeros(1)])
    return padded[ids]
