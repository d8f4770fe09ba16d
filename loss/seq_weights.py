"""Single-ratio importance weights at token and sequence level (docs/loss-spec.md §5): TIS / MIS / IcePop,
Seq-TIS / Seq-MIS, geometric-mean (Geo-RS) masks, veto, batch normalisation.

Owns the building blocks; `loss.baselines.single_ratio_loss` composes them into a loss.
Inputs are detached per-token log-ratios log ρ_t (`[B, T]` or packed `[N]` + `cu_seqlens`)
and a bool mask. Must never import `slime_async`.

Worked example (spec S1/S3): ρ = [1, 3, 0.25, 1.5] in one sequence
    ∏ρ = 1.125 → Seq-TIS (C = 2) weight 1.125 on all four tokens; geometric mean 1.125^(1/4)
"""

from __future__ import annotations

import torch

from loss.corrections import correct
from loss.ratios import broadcast_seq, seq_sum
from loss.types import Method


def _masked(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    d = torch.nan_to_num(log_ratio.detach(), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where(mask, d, 0.0)


def sequence_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Σ_t log ρ_t over the valid tokens of each sequence → `[B]` (log of ∏ρ)."""
    return seq_sum(_masked(log_ratio, mask), cu_seqlens)


def sequence_is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    method: Method | str = Method.CLIP,
    low: float = 0.0,
    high: float = 2.0,
    cu_seqlens: torch.Tensor | None = None,
    clamp: float = 20.0,
) -> torch.Tensor:
    """Seq-TIS (`clip`: min(∏ρ, C) with low = 0) or Seq-MIS (`cap`: ∏ρ·1[∏ρ ≤ C]) or IcePop on
    the sequence ratio, broadcast to every token of the sequence (0 outside `mask`)."""
    s = sequence_log_ratio(log_ratio, mask, cu_seqlens=cu_seqlens).clamp(-clamp, clamp)
    w_seq = correct(s.exp(), method, low, high).weight
    return torch.where(mask, broadcast_seq(w_seq, log_ratio, cu_seqlens), 0.0)


def geometric_mean_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """exp(mean_t log ρ_t) per sequence `[B]` (length-invariant; 1.0 for empty sequences)."""
    s = sequence_log_ratio(log_ratio, mask, cu_seqlens=cu_seqlens)
    n = seq_sum(mask.to(s.dtype), cu_seqlens)
    return (s / n.clamp(min=1)).exp()


def geometric_mask(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token keep mask: whole sequences whose geometric-mean ratio is within [low, high]."""
    if not 0 <= low < high:
        raise ValueError(f"geometric mask needs 0 <= low < high, got {low}, {high}.")
    g = geometric_mean_ratio(log_ratio, mask, cu_seqlens=cu_seqlens)
    ok = (g >= low) & (g <= high)
    return mask & broadcast_seq(ok, mask, cu_seqlens).bool()


def veto_mask(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    threshold: float = 1e-4,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token keep mask dropping every sequence with any valid token ρ_t < `threshold`
    (slime `rs_veto_threshold`, verl's former veto)."""
    if not threshold > 0:
        raise ValueError(f"veto threshold must be > 0 (slime uses 1e-4), got {threshold}.")
    low_tok = mask & (_masked(log_ratio, mask) < torch.log(torch.tensor(threshold)).item())
    vetoed = seq_sum(low_tok.to(torch.float32), cu_seqlens) > 0
    return mask & ~broadcast_seq(vetoed, mask, cu_seqlens).bool()


def batch_normalize(
    weights: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """w / mean(w): over valid tokens (`token`) or over per-sequence mean weights (`sequence`),
    applied after truncation (verl `rollout_is_batch_normalize`)."""
    w = torch.where(mask, weights.detach(), 0.0)
    if level == "token":
        mean = w.sum() / mask.sum().clamp(min=1)
    elif level == "sequence":
        n = seq_sum(mask.to(w.dtype), cu_seqlens)
        per_seq = seq_sum(w, cu_seqlens) / n.clamp(min=1)
        valid = n > 0
        mean = torch.where(valid, per_seq, 0.0).sum() / valid.sum().clamp(min=1)
    else:
        raise ValueError(f"level={level!r} is not supported; use 'token' or 'sequence'.")
    return w / mean.clamp(min=1e-12)
