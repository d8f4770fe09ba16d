"""Diagnostics of the CompIS loss (docs/loss-spec.md §13), per source: r1 drift, r2 engine, r3 staleness,
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
from loss.diagnostics import (
    Metric,
    multi_ratio_stats,
    percentiles,
    seq_chi2,
    to_floats,
)
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


def _token_sample(mask: torch.Tensor, sample: int) -> tuple[torch.Tensor | slice, torch.Tensor]:
    """(selector of sampled positions, positions among them that are valid). All positions
    when the batch is small; else a systematic sample (every `stride`-th position from a
    seeded random offset: unbiased, and a cheap strided read instead of a random gather)."""
    flat = mask.reshape(-1)
    n = flat.numel()
    if n <= sample:
        return slice(None), flat.nonzero().squeeze(1)
    stride = -(-n // sample)
    gen = torch.Generator().manual_seed(_SEED)
    offset = int(torch.randint(stride, (1,), generator=gen))
    sel = slice(offset, None, stride)
    return sel, flat[sel].nonzero().squeeze(1)


def _seq_subset(
    inputs: LossInputs, sample: int
) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """Whole sequences (all, or a systematic sample, every `stride`-th sequence from a seeded
    random offset, holding about `sample` positions) of the per-token tensors needed for
    sequence metrics, and their `cu_seqlens` (packed) or None."""
    names = ("proximal_logprobs", "rollout_logprobs", "behavior_logprobs", "loss_mask")
    full = {k: getattr(inputs, k) for k in names}
    total = inputs.loss_mask.numel()
    cu = inputs.cu_seqlens
    b = inputs.loss_mask.shape[0] if cu is None else cu.numel() - 1
    if total <= sample or b <= 1:
        return full, cu
    k = max(1, min(b, sample * b // total))
    gen = torch.Generator().manual_seed(_SEED)
    stride = -(-b // k)
    offset = int(torch.randint(stride, (1,), generator=gen))
    if cu is None:  # systematic sample of rows: a strided view, no copy
        return {n: (t[offset::stride] if t is not None else None) for n, t in full.items()}, None
    seqs = torch.arange(offset, b, stride)
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
    sel, pos = _token_sample(inputs.loss_mask, cfg.diag_sample_size)
    n = pos.numel()
    out: dict[str, Metric] = {"diag/sample_tokens": float(n)}
    if n == 0:
        return out
    dt = compute_dtype(
        inputs.logprobs, inputs.proximal_logprobs, inputs.rollout_logprobs, inputs.behavior_logprobs
    )

    def g(x: torch.Tensor) -> torch.Tensor:
        return upcast(x.detach()).reshape(-1)[sel].index_select(0, pos).to(dt)

    clamp, ss = cfg.log_ratio_clamp, cfg.diag_sample_size
    lp, lpk, lps = g(inputs.logprobs), g(inputs.proximal_logprobs), g(inputs.rollout_logprobs)
    d1 = safe_log_ratio(lp, lpk, clamp=clamp)
    lo1, hi1 = 1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high
    adv = g(inputs.advantages).nan_to_num_(0.0, 0.0, 0.0)
    r1 = d1.exp()
    up, down = (adv > 0) & (r1 > hi1), (adv < 0) & (r1 < lo1)
    lo3, hi3 = _bounds(cfg.staleness_method, cfg.staleness_low, cfg.staleness_high)
    if inputs.behavior_logprobs is None:
        d3 = safe_log_ratio(lpk, lps, clamp=clamp)
        c3, m3, k3 = correct_log(d3, cfg.staleness_method, cfg.staleness_low, cfg.staleness_high)
        names = ["is/combined", "is/drift", "is/weight"]
        rows = [d3, d1, c3]
        lows, highs = [lo3, lo1, None], [hi3, hi1, None]
        masked, clipped = [m3, None, m3], [k3, up | down, k3]
    else:
        lpm = g(inputs.behavior_logprobs)
        d2 = safe_log_ratio(lpm, lps, clamp=clamp)
        d3 = safe_log_ratio(lpk, lpm, clamp=clamp)
        c2, m2, k2 = correct_log(d2, cfg.engine_method, cfg.engine_low, cfg.engine_high)
        c3, m3, k3 = correct_log(d3, cfg.staleness_method, cfg.staleness_low, cfg.staleness_high)
        lo2, hi2 = _bounds(cfg.engine_method, cfg.engine_low, cfg.engine_high)
        names = ["is/engine", "is/staleness", "is/combined", "is/drift", "is/weight"]
        rows = [d2, d3, (d2 + d3).clamp_(-clamp, clamp), d1, c2 + c3]
        lows, highs = [lo2, lo3, None, lo1, None], [hi2, hi3, None, hi1, None]
        masked, clipped = [m2, m3, None, None, _or(m2, m3)], [k2, k3, None, up | down, _or(k2, k3)]
    out.update(
        multi_ratio_stats(
            names,
            torch.stack(rows),
            lows=lows,
            highs=highs,
            masked=masked,
            clipped=clipped,
            with_kl=[True] * (len(names) - 1) + [False],
            sample_size=ss,
        )
    )
    out["loss/kept_frac"] = 1.0 - out["is/weight/masked_frac"]
    # PPO clip fractions on r1, judged with the original advantage sign
    f64 = torch.float64
    pol = {
        "policy/clipfrac_upper": up.sum().to(f64) / n,
        "policy/clipfrac_lower": down.sum().to(f64) / n,
        "policy/approx_kl": -d1.sum(dtype=f64) / n,
        "policy/logprob_mean": lp.sum(dtype=f64) / n,
        "policy/advantage_mean": adv.sum(dtype=f64) / n,
    }
    if inputs.behavior_logprobs is not None:  # per-source weights w2 = f2(r2), w3 = f3(r3)
        pol["is/engine/weight_mean"] = c2.exp().sum(dtype=f64) / n
        pol["is/staleness/weight_mean"] = c3.exp().sum(dtype=f64) / n
    if cfg.dual_clip_c is not None:
        pol["policy/dual_clip_frac"] = ((adv < 0) & (r1 > cfg.dual_clip_c)).sum().to(f64) / n
    pol_f = to_floats(pol)
    pol_f["policy/clipfrac"] = pol_f["policy/clipfrac_upper"] + pol_f["policy/clipfrac_lower"]
    out.update(pol_f)
    if inputs.token_versions is not None and inputs.current_version is not None:
        lag = (
            inputs.current_version - inputs.token_versions.reshape(-1)[sel].index_select(0, pos)
        ).to(f64)
        out["is/staleness/version_lag_mean"] = float(lag.mean())
        out["is/staleness/version_lag_max"] = float(lag.max())
        out["is/staleness/version_lag_p90"] = percentiles(lag, (90.0,), sample_size=ss)[0]
    out.update(_sequence_metrics(inputs, cfg))
    return out


def _sequence_metrics(inputs: LossInputs, cfg: CompISConfig) -> dict[str, Metric]:
    """χ² of ∏ρ per sequence (per source) and slime's train/rollout |Δlogp| (seq-mean of
    token-mean), on all sequences or a random subset of whole sequences; one segment sum."""
    sub, cu = _seq_subset(inputs, cfg.diag_sample_size)
    mask = sub["loss_mask"]
    lpk, lps, lpm = sub["proximal_logprobs"], sub["rollout_logprobs"], sub["behavior_logprobs"]
    assert mask is not None and lpk is not None and lps is not None
    clamp = cfg.log_ratio_clamp
    dt = compute_dtype(lpk, lps, lpm)
    lpk, lps = upcast(lpk).to(dt), upcast(lps).to(dt)
    cols = [safe_log_ratio(lpk, lps, clamp=clamp), (lpk - lps).abs()]
    if lpm is not None:
        lpm = upcast(lpm).to(dt)
        cols += [
            safe_log_ratio(lpm, lps, clamp=clamp),
            safe_log_ratio(lpk, lpm, clamp=clamp),
            (lpm - lps).abs(),
        ]
    mask_f = mask.to(dt).unsqueeze(-1)
    # finite after nan_to_num, so multiplying by the 0/1 mask is as safe as `where` (and faster)
    stacked = torch.cat(
        [mask_f, torch.stack(cols, dim=-1).nan_to_num_(0.0, 0.0, 0.0).mul_(mask_f)], dim=-1
    )
    sums = seq_sum(stacked, cu).reshape(-1, stacked.shape[-1])
    sums = sums.to(torch.float64)
    f64 = torch.float64
    count = sums[:, 0]
    valid = count > 0
    nv = valid.sum().clamp(min=1)

    def seq_mean_of_token_mean(col: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, col / count.clamp(min=1), 0.0).sum() / nv

    out: dict[str, Metric] = {
        "mismatch/train_rollout_logprob_abs_diff": seq_mean_of_token_mean(sums[:, 2]),
        "diag/sample_seqs": valid.sum().to(f64),
    }
    if lpm is None:
        out["is/combined/chi2_seq"] = seq_chi2(sums[:, 1], valid)
    else:
        out["is/combined/chi2_seq"] = seq_chi2(sums[:, 1], valid)
        out["is/engine/chi2_seq"] = seq_chi2(sums[:, 3], valid)
        out["is/staleness/chi2_seq"] = seq_chi2(sums[:, 4], valid)
        out["mismatch/engine_logprob_abs_diff"] = seq_mean_of_token_mean(sums[:, 5])
    return to_floats(out)
