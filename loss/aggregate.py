"""Loss aggregation (docs/loss-spec.md §10) with global (whole mini-batch, all DP ranks) denominators.

Owns: `aggregate`, `denominators`. With the global denominators of the whole mini-batch,
the aggregated loss of one micro-batch is its *share*: summing micro-batches (and DP ranks)
gives exactly the full-batch loss and gradient. Must never import `slime_async`.

Worked example (spec L1): L = [[1, 2, 3, 0], [4, 0, 0, 0]], mask = [[1, 1, 1, 0], [1, 0, 0, 0]]
    token-mean 10/4 = 2.5; seq-mean-token-mean (2 + 4)/2 = 3.0; seq-mean-token-sum (6 + 4)/2 = 5.0;
    seq-mean-token-sum-norm with H = 4: 5.0/4 = 1.25
"""

from __future__ import annotations

import torch

from loss.ratios import segment_ids, seq_sum
from loss.types import AggMode, parse_enum


def denominators(
    mask: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None
) -> tuple[float, float]:
    """(valid tokens, sequences with ≥ 1 valid token) of one micro-batch, as floats.

    Sum these over all micro-batches and DP ranks (all-reduce) to get the global denominators.
    """
    counts = seq_sum(mask.to(torch.float64), cu_seqlens)
    return float(counts.sum()), float((counts > 0).sum())


def aggregate(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode | str,
    *,
    cu_seqlens: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    premasked: bool = False,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses (`[B, T]`, or packed `[N]` + `cu_seqlens`) to a scalar.

    token-mean: Σ_i S_i / Σ_i n_i. seq-mean-token-mean: mean_{i∈V} S_i / n_i. seq-mean-token-sum:
    mean_{i∈V} S_i. seq-mean-token-sum-norm: mean_{i∈V} S_i / H (H = `loss_scale_factor`).
    S_i, n_i: masked token sum and count of sequence i; V: sequences with n_i > 0. The global
    counts replace Σ n_i and |V| when given. `premasked=True` promises the loss is already 0
    outside `mask` (skips one `where`). Empty batches give 0, not NaN.
    """
    m = parse_enum(AggMode, mode, field="agg_mode")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}; pass mask.bool().")
    if mask.shape != per_token_loss.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} != loss shape {tuple(per_token_loss.shape)}."
        )
    if m is AggMode.SEQ_MEAN_TOKEN_SUM_NORM and not (loss_scale_factor and loss_scale_factor > 0):
        raise ValueError(
            "seq-mean-token-sum-norm needs loss_scale_factor = H > 0 (a constant such as the max "
            "response length); without it the loss scale would depend on padding."
        )
    lm = per_token_loss if premasked else torch.where(mask, per_token_loss, 0.0)
    return aggregate_premasked(
        lm,
        mask.to(lm.dtype),
        m,
        cu_seqlens=cu_seqlens,
        loss_scale_factor=loss_scale_factor,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        ids=ids,
    )


def aggregate_premasked(
    lm: torch.Tensor,
    mask_f: torch.Tensor,
    mode: AggMode,
    *,
    cu_seqlens: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """`aggregate` for a loss that is already 0 outside the mask, with a 0/1 float mask
    (the fast path: no bool ops, which are slow on CPU)."""
    if mode is AggMode.TOKEN_MEAN:
        den = global_num_tokens if global_num_tokens is not None else mask_f.sum().clamp(min=1)
        return lm.sum() / den
    if cu_seqlens is not None and ids is None:
        ids = segment_ids(cu_seqlens, lm.shape[0])
    sums = seq_sum(lm, cu_seqlens, ids=ids)
    counts = seq_sum(mask_f, cu_seqlens, ids=ids)
    nseq = global_num_seqs if global_num_seqs is not None else (counts > 0).sum().clamp(min=1)
    if mode is AggMode.SEQ_MEAN_TOKEN_MEAN:
        return (sums / counts.clamp(min=1)).sum() / nseq
    total = sums.sum() / nseq
    if mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        total = total / loss_scale_factor
    return total
