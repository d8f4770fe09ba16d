"""Diagnostics of the CompIS loss (spec §13), per source: r1 drift, r2 engine, r3 staleness,
r2·r3 combined, and the final weight w; plus PPO clip fractions and mismatch metrics.

Owns: `compis_metrics`. All statistics are over valid tokens *before* any correction mask.
Batches of up to `cfg.diag_sample_size` tokens are measured exactly; larger ones on a uniform
random sample of that many positions (token metrics) and of whole sequences (sequence metrics),
with a fixed seed, so diagnostics stay a few milliseconds even at tens of millions of tokens
(`diag/sample_tokens` says how many tokens were used). Must never import `slime_async`.
"""

from __future__ import annotations

import torch

from loss.corrections import correct_log
from loss.diagnostics import Metric, abs_diff_seq_mean, percentiles, ratio_stats, seq_chi2
from loss.ratios import safe_log_ratio, seq_sum
from loss.types import CompISConfig, LossInputs, Method, compute_dtype, upcast

_SEED = 20240611


def _bounds(method: Method, low: float, high: float) -> tuple[float | None, float | None]:
    if method is Method.NONE:
        return None, None
    return (None if method is Method.CAP else low), high


def _or(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a | b


def _token_positions(mask: torch.Tensor, sample: int) -> torch.Tensor:
    """Flat indices of valid tokens: all of them, or a uniform sample when the batch is large."""
    flat = mask.reshape(-1)
    if flat.numel() <= sample:
        return flat.nonzero().squeeze(1)
    gen = torch.Generator().manual_seed(_SEED)
    pos = torch.randint(flat.numel(), (sample,), generator=gen).to(flat.device)
    return pos[flat.index_select(0, pos)]


def _seq_subset(
    inputs: LossInputs, sample: int
) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """Whole sequences (all, or a random subset holding about `sample` positions) of the
    per-token tensors needed for sequence metrics, and their `cu_seqlens` (packed) or None."""
    names = ("proximal_logprobs", "rollout_logprobs", "behavior_logprobs", "loss_mask")
    full = {k: getattr(inputs, k) for k in names}
    total = inputs.loss_mask.numel()
    cu = inputs.cu_seqlens
    b = inputs.loss_mask.shape[0] if cu is None else cu.numel() - 1
    if total <= sample or b <= 1:
        return full, cu
    k = max(1, min(b, sample * b // total))
    gen = torch.Generator().manual_seed(_SEED)
    seqs = torch.randperm(b, generator=gen)[:k].sort().values
    if cu is None:
        idx = seqs.to(inputs.loss_mask.device)
        return {
            n: (t.index_select(0, idx) if t is not None else None) for n, t in full.items()
        }, None
    cu_cpu = cu.to("cpu", torch.int64)
    starts, lens = cu_cpu[seqs], cu_cpu[seqs + 1] - cu_cpu[seqs]
    offsets = torch.cumsum(lens, 0) - lens
    tok = torch.arange(int(lens.sum())) - torch.repeat_interleave(offsets - starts, lens)
    tok = tok.to(inputs.loss_mask.device)
    new_cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)]).to(cu.device)
    return {n: (t.index_select(0, tok) if t is not None else None) for n, t in full.items()}, new_cu


def compis_metrics(inputs: LossInputs, cfg: CompISConfig) -> dict[str, Metric]:
    """Namespaced diagnostics: `is/{drift,engine,staleness,combined,weight}/*`, `policy/*`,
    `mismatch/*`, `loss/kept_frac`, `diag/sample_tokens` (values are 0-d tensors or floats)."""
    pos = _token_positions(inputs.loss_mask, cfg.diag_sample_size)
    n = pos.numel()
    out: dict[str, Metric] = {"diag/sample_tokens": float(n)}
    if n == 0:
        return out
    dt = compute_dtype(
        inputs.logprobs, inputs.proximal_logprobs, inputs.rollout_logprobs, inputs.behavior_logprobs
    )

    def g(x: torch.Tensor) -> torch.Tensor:
        return upcast(x.detach()).reshape(-1).index_select(0, pos).to(dt)

    clamp, ss = cfg.log_ratio_clamp, cfg.diag_sample_size
    lp, lpk, lps = g(inputs.logprobs), g(inputs.proximal_logprobs), g(inputs.rollout_logprobs)
    fb = inputs.behavior_logprobs is None
    lo3, hi3 = _bounds(cfg.staleness_method, cfg.staleness_low, cfg.staleness_high)
    if fb:
        d3 = safe_log_ratio(lpk, lps, clamp=clamp)
        c3, m3, k3 = correct_log(d3, cfg.staleness_method, cfg.staleness_low, cfg.staleness_high)
        out.update(
            ratio_stats(
                "is/combined",
                d3.exp(),
                d3,
                low=lo3,
                high=hi3,
                masked=m3,
                clipped=k3,
                sample_size=ss,
            )
        )
        logw, m_any, k_any = c3, m3, k3
    else:
        lpm = g(inputs.behavior_logprobs)
        d2 = safe_log_ratio(lpm, lps, clamp=clamp)
        d3 = safe_log_ratio(lpk, lpm, clamp=clamp)
        c2, m2, k2 = correct_log(d2, cfg.engine_method, cfg.engine_low, cfg.engine_high)
        c3, m3, k3 = correct_log(d3, cfg.staleness_method, cfg.staleness_low, cfg.staleness_high)
        lo2, hi2 = _bounds(cfg.engine_method, cfg.engine_low, cfg.engine_high)
        out.update(
            ratio_stats(
                "is/engine", d2.exp(), d2, low=lo2, high=hi2, masked=m2, clipped=k2, sample_size=ss
            )
        )
        out.update(
            ratio_stats(
                "is/staleness",
                d3.exp(),
                d3,
                low=lo3,
                high=hi3,
                masked=m3,
                clipped=k3,
                sample_size=ss,
            )
        )
        dc = (d2 + d3).clamp_(-clamp, clamp)
        out.update(ratio_stats("is/combined", dc.exp(), dc, sample_size=ss))
        logw, m_any, k_any = c2 + c3, _or(m2, m3), _or(k2, k3)
    w = logw.exp()
    out.update(ratio_stats("is/weight", w, masked=m_any, clipped=k_any, sample_size=ss))
    out["loss/kept_frac"] = (w > 0).sum() / n
    # drift r1 and the PPO clip fractions, judged with the original advantage sign
    d1 = safe_log_ratio(lp, lpk, clamp=clamp)
    r1 = d1.exp()
    lo1, hi1 = 1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high
    adv = g(inputs.advantages).nan_to_num_(0.0, 0.0, 0.0)
    up, down = (adv > 0) & (r1 > hi1), (adv < 0) & (r1 < lo1)
    out.update(
        ratio_stats("is/drift", r1, d1, low=lo1, high=hi1, clipped=up | down, sample_size=ss)
    )
    out["policy/clipfrac"] = (up | down).sum() / n
    out["policy/clipfrac_upper"] = up.sum() / n
    out["policy/clipfrac_lower"] = down.sum() / n
    if cfg.dual_clip_c is not None:
        out["policy/dual_clip_frac"] = ((adv < 0) & (r1 > cfg.dual_clip_c)).sum() / n
    out["policy/approx_kl"] = -d1.sum(dtype=torch.float64) / n
    out["policy/logprob_mean"] = lp.sum(dtype=torch.float64) / n
    out["policy/advantage_mean"] = adv.sum(dtype=torch.float64) / n
    if inputs.token_versions is not None and inputs.current_version is not None:
        lag = (inputs.current_version - inputs.token_versions.reshape(-1).index_select(0, pos)).to(
            torch.float64
        )
        out["is/staleness/version_lag_mean"] = lag.mean()
        out["is/staleness/version_lag_max"] = lag.max()
        out["is/staleness/version_lag_p90"] = percentiles(lag, (90.0,), sample_size=ss)[0]
    out.update(_sequence_metrics(inputs, cfg))
    return out


def _sequence_metrics(inputs: LossInputs, cfg: CompISConfig) -> dict[str, Metric]:
    """χ² of ∏ρ per sequence (per source) and slime's train/rollout |Δlogp| (seq-mean of
    token-mean), on all sequences or a random subset of whole sequences."""
    sub, cu = _seq_subset(inputs, cfg.diag_sample_size)
    mask = sub["loss_mask"]
    assert mask is not None
    clamp = cfg.log_ratio_clamp
    out: dict[str, Metric] = {}
    lpk, lps, lpm = sub["proximal_logprobs"], sub["rollout_logprobs"], sub["behavior_logprobs"]
    assert lpk is not None and lps is not None
    if lpm is None:
        cols = [safe_log_ratio(lpk, lps, clamp=clamp)]
    else:
        cols = [safe_log_ratio(lpm, lps, clamp=clamp), safe_log_ratio(lpk, lpm, clamp=clamp)]
    mf = mask.to(torch.float64)
    stacked = torch.stack(
        [mf] + [torch.where(mask, c.to(torch.float64), 0.0) for c in cols], dim=-1
    )
    sums = seq_sum(stacked, cu)
    valid = sums[..., 0] > 0
    if lpm is None:
        out["is/combined/chi2_seq"] = seq_chi2(sums[..., 1], valid)
    else:
        out["is/engine/chi2_seq"] = seq_chi2(sums[..., 1], valid)
        out["is/staleness/chi2_seq"] = seq_chi2(sums[..., 2], valid)
        out["is/combined/chi2_seq"] = seq_chi2(sums[..., 1] + sums[..., 2], valid)
        out["mismatch/engine_logprob_abs_diff"] = abs_diff_seq_mean(lpm, lps, mask, cu_seqlens=cu)
    out["mismatch/train_rollout_logprob_abs_diff"] = abs_diff_seq_mean(
        lpk, lps, mask, cu_seqlens=cu
    )
    out["diag/sample_seqs"] = float(valid.sum())
    return out
