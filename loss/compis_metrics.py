"""Diagnostics of the CompIS loss (docs/loss-spec.md §13), per source: r1 drift, r2 engine, r3 staleness,
r2·r3 combined, and the final weight w; plus PPO clip fractions and mismatch metrics.

Owns: `compis_metrics`. All statistics are over valid tokens *before* any correction mask.
Batches of up to `cfg.diag_sample_size` tokens are measured exactly; larger ones on a uniform
random sample of that many positions (token metrics) and of whole sequences (sequence metrics),
with a fixed seed, so diagnostics stay a few milliseconds even at tens of millions of tokens
(`diag/sample_tokens` says how many tokens were used). Must never import `slime_async`.
"""

from __future__ import annotations

import dataclasses

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

    lp, lpk, lps = g(inputs.logprobs), g(inputs.proximal_logprobs), g(inputs.rollout_logprobs)
    lpm = None if inputs.behavior_logprobs is None else g(inputs.behavior_logprobs)
    t = _Tokens(
        lp=lp,
        d1=safe_log_ratio(lp, lpk, clamp=cfg.log_ratio_clamp),
        adv=g(inputs.advantages).nan_to_num_(0.0, 0.0, 0.0),
        cfg=cfg,
    )
    src = _sources(t, lpk=lpk, lps=lps, lpm=lpm)
    out.update(
        multi_ratio_stats(
            src.names,
            torch.stack(src.rows),
            lows=src.lows,
            highs=src.highs,
            masked=src.masked,
            clipped=src.clipped,
            with_kl=[True] * (len(src.names) - 1) + [False],
            sample_size=cfg.diag_sample_size,
        )
    )
    out["loss/kept_frac"] = 1.0 - out["is/weight/masked_frac"]
    out.update(_policy_metrics(t, src, n))
    if inputs.token_versions is not None and inputs.current_version is not None:
        versions = inputs.token_versions.reshape(-1)[sel].index_select(0, pos)
        out.update(_version_lag(inputs.current_version, versions, cfg.diag_sample_size))
    out.update(_sequence_metrics(inputs, cfg))
    return out


class _Tokens:
    """The sampled valid tokens' current log-probs, drift log-ratio d1 = log r1 and
    advantages (`[n]` each), with r1's PPO clip masks judged on the advantage sign."""

    def __init__(
        self, *, lp: torch.Tensor, d1: torch.Tensor, adv: torch.Tensor, cfg: CompISConfig
    ) -> None:
        self.lp, self.d1, self.adv, self.cfg = lp, d1, adv, cfg
        self.lo1, self.hi1 = 1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high
        self.r1 = d1.exp()
        self.up = (adv > 0) & (self.r1 > self.hi1)
        self.down = (adv < 0) & (self.r1 < self.lo1)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Sources:
    """The per-source log-ratio rows `multi_ratio_stats` reads, with their bounds, masks and
    clips, and the corrected log-weights of each source (engine: None without π_j^Meg)."""

    names: list[str]
    rows: list[torch.Tensor]
    lows: list[float | None]
    highs: list[float | None]
    masked: list[torch.Tensor | None]
    clipped: list[torch.Tensor | None]
    engine_log_weight: torch.Tensor | None
    staleness_log_weight: torch.Tensor


def _sources(
    t: _Tokens, *, lpk: torch.Tensor, lps: torch.Tensor, lpm: torch.Tensor | None
) -> _Sources:
    """Drift, staleness (combined when there is no behavior log-prob `lpm`), engine and the
    final weight, as `[n]` log-ratios."""
    cfg, clamp = t.cfg, t.cfg.log_ratio_clamp
    lo3, hi3 = _bounds(cfg.staleness_method, cfg.staleness_low, cfg.staleness_high)
    ppo = t.up | t.down
    if lpm is None:
        d3 = safe_log_ratio(lpk, lps, clamp=clamp)
        c3, m3, k3 = correct_log(d3, cfg.staleness_method, cfg.staleness_low, cfg.staleness_high)
        return _Sources(
            names=["is/combined", "is/drift", "is/weight"],
            rows=[d3, t.d1, c3],
            lows=[lo3, t.lo1, None],
            highs=[hi3, t.hi1, None],
            masked=[m3, None, m3],
            clipped=[k3, ppo, k3],
            engine_log_weight=None,
            staleness_log_weight=c3,
        )
    d2 = safe_log_ratio(lpm, lps, clamp=clamp)
    d3 = safe_log_ratio(lpk, lpm, clamp=clamp)
    c2, m2, k2 = correct_log(d2, cfg.engine_method, cfg.engine_low, cfg.engine_high)
    c3, m3, k3 = correct_log(d3, cfg.staleness_method, cfg.staleness_low, cfg.staleness_high)
    lo2, hi2 = _bounds(cfg.engine_method, cfg.engine_low, cfg.engine_high)
    return _Sources(
        names=["is/engine", "is/staleness", "is/combined", "is/drift", "is/weight"],
        rows=[d2, d3, (d2 + d3).clamp_(-clamp, clamp), t.d1, c2 + c3],
        lows=[lo2, lo3, None, t.lo1, None],
        highs=[hi2, hi3, None, t.hi1, None],
        masked=[m2, m3, None, None, _or(m2, m3)],
        clipped=[k2, k3, None, ppo, _or(k2, k3)],
        engine_log_weight=c2,
        staleness_log_weight=c3,
    )


def _policy_metrics(t: _Tokens, src: _Sources, n: int) -> dict[str, float]:
    """PPO clip fractions on r1 (judged with the original advantage sign), approximate KL,
    means, and the per-source weight means w2 = f2(r2), w3 = f3(r3) when both exist."""
    f64 = torch.float64
    pol = {
        "policy/clipfrac_upper": t.up.sum().to(f64) / n,
        "policy/clipfrac_lower": t.down.sum().to(f64) / n,
        "policy/approx_kl": -t.d1.sum(dtype=f64) / n,
        "policy/logprob_mean": t.lp.sum(dtype=f64) / n,
        "policy/advantage_mean": t.adv.sum(dtype=f64) / n,
    }
    if src.engine_log_weight is not None:  # per-source weights w2 = f2(r2), w3 = f3(r3)
        pol["is/engine/weight_mean"] = src.engine_log_weight.exp().sum(dtype=f64) / n
        pol["is/staleness/weight_mean"] = src.staleness_log_weight.exp().sum(dtype=f64) / n
    if t.cfg.dual_clip_c is not None:
        dual = (t.adv < 0) & (t.r1 > t.cfg.dual_clip_c)
        pol["policy/dual_clip_frac"] = dual.sum().to(f64) / n
    pol_f = to_floats(pol)
    pol_f["policy/clipfrac"] = pol_f["policy/clipfrac_upper"] + pol_f["policy/clipfrac_lower"]
    return pol_f


def _version_lag(current: int, versions: torch.Tensor, sample_size: int) -> dict[str, Metric]:
    """How many versions behind the current one the sampled tokens were generated."""
    lag = (current - versions).to(torch.float64)
    return {
        "is/staleness/version_lag_mean": float(lag.mean()),
        "is/staleness/version_lag_max": float(lag.max()),
        "is/staleness/version_lag_p90": percentiles(lag, (90.0,), sample_size=sample_size)[0],
    }


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
