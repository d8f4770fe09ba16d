"""Off-policy diagnostics (docs/loss-spec.md §13): ratio statistics, KL estimators, mismatch metrics.

Owns: `ratio_stats` (mean/std/min/max/p50/p90/p99, fractions beyond bounds, masked/clipped
fractions, ESS, χ², KL k1/k2/k3), `kl_estimators`, `percentiles` (numpy "linear" on a CPU copy,
subsampled past `sample_size` so tens of millions of tokens work), `abs_diff_seq_mean`, and
`to_floats` (one device sync for a whole metric dict). Inputs are compact 1-D vectors of the
valid tokens, taken *before* any correction masks. Must never import `slime_async`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from loss.ratios import seq_sum

Metric = torch.Tensor | float


def percentiles(
    x: torch.Tensor, qs: tuple[float, ...] = (50.0, 90.0, 99.0), *, sample_size: int = 65536
) -> list[float]:
    """Linear-interpolated percentiles of a 1-D tensor, computed with numpy on a CPU copy.

    Exact when `x.numel() <= sample_size`; otherwise on `sample_size` elements drawn with a fixed
    seed (deterministic; sampling error of p99 on 65536 draws is ~0.04 percentile points).
    """
    n = x.numel()
    if n == 0:
        return [math.nan] * len(qs)
    if n > sample_size:
        gen = torch.Generator().manual_seed(1234)
        idx = torch.randint(n, (sample_size,), generator=gen).to(x.device)
        x = x.index_select(0, idx)
    arr = x.detach().to("cpu", torch.float64).numpy()
    return [float(v) for v in np.percentile(arr, qs, method="linear")]


def kl_estimators(log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample KL(μ‖π) estimators for ρ = π/μ with samples from μ: k1 = −log ρ,
    k2 = ½(log ρ)², k3 = ρ − 1 − log ρ (≥ 0, unbiased)."""
    d = log_ratio.detach()
    return -d, 0.5 * d * d, torch.expm1(d) - d


def multi_ratio_stats(
    prefixes: list[str],
    log_ratios: torch.Tensor,
    *,
    lows: list[float | None] | None = None,
    highs: list[float | None] | None = None,
    masked: list[torch.Tensor | None] | None = None,
    clipped: list[torch.Tensor | None] | None = None,
    with_kl: list[bool] | None = None,
    sample_size: int = 65536,
) -> dict[str, float]:
    """`ratio_stats` for S sources at once from log-ratios `[S, n]` (−inf allowed: ratio 0),
    with one pass per statistic over the stacked tensor and a single device sync."""
    s_count, n = log_ratios.shape
    lows = lows or [None] * s_count
    highs = highs or [None] * s_count
    masked = masked or [None] * s_count
    clipped = clipped or [None] * s_count
    with_kl = with_kl or [True] * s_count
    out: dict[str, float] = {}
    if n == 0:
        return out
    d = log_ratios.detach()
    r = d.exp()
    sums = _row_sums(d, r, lows=lows, highs=highs, masked=masked, clipped=clipped)
    pct = percentiles_rows(r, sample_size=sample_size)
    for i, p in enumerate(prefixes):
        out.update(
            _source_stats(
                p,
                n,
                [row[i] for row in sums],
                pct[i],
                has_low=lows[i] is not None,
                has_high=highs[i] is not None,
                with_kl=with_kl[i],
            )
        )
    return out


def _row_sums(
    d: torch.Tensor,
    r: torch.Tensor,
    *,
    lows: list[float | None],
    highs: list[float | None],
    masked: list[torch.Tensor | None],
    clipped: list[torch.Tensor | None],
) -> list[list[float]]:
    """Per source (row of the log-ratios `d` `[S, n]`, `r` = exp `d`): Σρ, Σρ², Σlog ρ, Σ(log ρ)² (non-finite
    log ρ as 0), min ρ, max ρ, counts above `highs` / below `lows`, masked and clipped counts;
    one pass per statistic and a single device sync. `[10][S]` floats."""
    f64 = torch.float64
    fin = torch.nan_to_num(d, nan=0.0, posinf=0.0, neginf=0.0)
    hi = torch.tensor([math.inf if h is None else h for h in highs], dtype=r.dtype, device=r.device)
    lo = torch.tensor([-math.inf if v is None else v for v in lows], dtype=r.dtype, device=r.device)
    zeros = torch.zeros((), dtype=f64, device=r.device)
    # sums in the input dtype (torch reduces pairwise: fp32 keeps ~1e-7 relative accuracy)
    rows = [
        r.sum(1),
        (r * r).sum(1),
        fin.sum(1),
        (fin * fin).sum(1),
        r.amin(1),
        r.amax(1),
        (r > hi[:, None]).sum(1),
        (r < lo[:, None]).sum(1),
        torch.stack([zeros if m is None else m.sum().to(f64) for m in masked]),
        torch.stack([zeros if c is None else c.sum().to(f64) for c in clipped]),
    ]
    return torch.stack([x.to(f64) for x in rows]).cpu().tolist()


def _source_stats(
    p: str,
    n: int,
    sums: list[float],
    pct: list[float],
    *,
    has_low: bool,
    has_high: bool,
    with_kl: bool,
) -> dict[str, float]:
    """`p/*` statistics of one source from its `_row_sums` column and percentiles (pure)."""
    s1, s2, m1, m2, mn, mx, above, below, nm, nc = sums
    mean = s1 / n
    out = {
        f"{p}/mean": mean,
        f"{p}/std": math.sqrt(max(s2 / n - mean * mean, 0.0)),
        f"{p}/min": mn,
        f"{p}/max": mx,
    }
    out[f"{p}/p50"], out[f"{p}/p90"], out[f"{p}/p99"] = pct
    if has_high:
        out[f"{p}/frac_above_high"] = above / n
    if has_low:
        out[f"{p}/frac_below_low"] = below / n
    out[f"{p}/masked_frac"] = nm / n
    out[f"{p}/clipped_frac"] = nc / n
    out[f"{p}/ess"] = s1 * s1 / (n * s2) if s2 > 0 else 0.0
    out[f"{p}/chi2_token"] = s2 / n - 1.0
    if with_kl:
        out[f"{p}/kl_k1"] = -m1 / n
        out[f"{p}/kl_k2"] = 0.5 * m2 / n
        out[f"{p}/kl_k3"] = mean - 1.0 - m1 / n
    return out


def percentiles_rows(
    x: torch.Tensor, qs: tuple[float, ...] = (50.0, 90.0, 99.0), *, sample_size: int = 65536
) -> list[list[float]]:
    """Row-wise linear percentiles of `[S, n]` on a CPU copy (columns subsampled past
    `sample_size`, fixed seed)."""
    n = x.shape[1]
    if n > sample_size:
        gen = torch.Generator().manual_seed(1234)
        x = x.index_select(1, torch.randint(n, (sample_size,), generator=gen).to(x.device))
    arr = x.detach().to("cpu", torch.float64).numpy()
    return np.percentile(arr, qs, axis=1, method="linear").T.tolist()


def ratio_stats(
    prefix: str,
    ratio: torch.Tensor,
    log_ratio: torch.Tensor | None = None,
    *,
    low: float | None = None,
    high: float | None = None,
    masked: torch.Tensor | None = None,
    clipped: torch.Tensor | None = None,
    sample_size: int = 65536,
) -> dict[str, float]:
    """Statistics of a compact 1-D ratio vector over valid tokens, keys `f"{prefix}/{name}"`.

    mean, std (population), min, max, p50/p90/p99, frac_above_high (r > high), frac_below_low
    (r < low), masked_frac, clipped_frac, ess = (Σr)²/(N·Σr²), chi2_token = mean(r²) − 1, and
    with `log_ratio` the KL estimators kl_k1/kl_k2/kl_k3 (means) of docs/loss-spec.md §13.
    """
    d = log_ratio if log_ratio is not None else torch.log(ratio.detach())
    return multi_ratio_stats(
        [prefix],
        d.reshape(1, -1),
        lows=[low],
        highs=[high],
        masked=[masked],
        clipped=[clipped],
        with_kl=[log_ratio is not None],
        sample_size=sample_size,
    )


def seq_chi2(seq_log_ratio_sums: torch.Tensor, valid_seqs: torch.Tensor) -> torch.Tensor:
    """Sequence-level χ² = mean over valid sequences of (∏_t ρ_t)² − 1 (log-sum clamped at 40)."""
    s = seq_log_ratio_sums.to(torch.float64).clamp(max=40.0)
    nv = valid_seqs.sum().clamp(min=1)
    return torch.where(valid_seqs, torch.exp(2.0 * s), 0.0).sum() / nv - 1.0


def abs_diff_seq_mean(
    logprobs_a: torch.Tensor,
    logprobs_b: torch.Tensor,
    mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """slime's `train_rollout_logprob_abs_diff`: mean over sequences of the token-mean of
    |a − b| over valid tokens (sequences without valid tokens are skipped)."""
    diff = torch.where(
        mask, (logprobs_a.detach().double() - logprobs_b.detach().double()).abs(), 0.0
    )
    diff = torch.nan_to_num(diff, nan=0.0, posinf=0.0, neginf=0.0)
    sums = seq_sum(torch.stack([diff, mask.double()], dim=-1), cu_seqlens)
    valid = sums[..., 1] > 0
    per_seq = sums[..., 0] / sums[..., 1].clamp(min=1)
    return torch.where(valid, per_seq, 0.0).sum() / valid.sum().clamp(min=1)


def to_floats(metrics: dict[str, Metric]) -> dict[str, float]:
    """Convert a dict of 0-d tensors / floats to plain floats with a single device sync."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if keys:
        vals = (
            torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in keys])
            .cpu()
            .tolist()
        )
        out.update(zip(keys, vals))
    return {k: out[k] for k in metrics}
