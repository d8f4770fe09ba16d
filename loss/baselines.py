"""Baseline off-policy losses in the same shape as CompIS: `fn(LossInputs, ...) -> LossOutputs`.

Owns, by section of docs/loss-spec.md: `decoupled_ppo_loss` (AReaL single combined ratio,
cap 5.0; §4), `single_ratio_loss` (token/sequence TIS, MIS, IcePop, Geo-RS, veto, batch norm;
§5), `m2po_mask`/`m2po_loss` (second-moment masking, paper/AReaL form; §6), `gspo_loss` (§7)
and `prime_masked_is_loss` (prime-rl pre-IPO token/geo/sequence masks; §12). Each takes its
config from `loss.baseline_configs` (or the same settings as keyword arguments). Must never
import `slime_async`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from loss.aggregate import aggregate, denominators
from loss.baseline_configs import (
    DecoupledPPOConfig,
    GSPOConfig,
    M2POConfig,
    PrimeMaskedISConfig,
    SingleRatioConfig,
    config_of,
)
from loss.compis import compis_loss
from loss.corrections import correct
from loss.diagnostics import Metric, ratio_stats, to_floats
from loss.ppo import ppo_core
from loss.ratios import broadcast_seq, safe_log_ratio, seq_sum
from loss.seq_weights import batch_normalize, geometric_mask, sequence_is_weights, veto_mask
from loss.types import (
    AggMode,
    CompISConfig,
    Denom,
    LossInputs,
    LossOutputs,
    Method,
    PPOConfig,
    upcast,
)


def weighted_ppo(
    inputs: LossInputs,
    weight: torch.Tensor,
    denom_mask: torch.Tensor,
    cfg: PPOConfig,
    *,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w·PPO(r1, A) aggregated with `denom_mask` as denominator, with `cfg`'s PPO knobs.
    `weight` is detached and 0 wherever the token must not contribute. Returns (loss,
    per-token clipped flags)."""
    adv = torch.where(inputs.loss_mask, inputs.advantages.detach(), 0.0) * weight.detach()
    terms = ppo_core(
        inputs.logprobs,
        inputs.proximal_logprobs,
        adv,
        cfg.eps_clip,
        cfg.eps_clip_high,
        cfg.dual_clip_c,
        mask=inputs.loss_mask,
        log_ratio_clamp=log_ratio_clamp,
    )
    loss = aggregate(
        terms.loss,
        denom_mask,
        cfg.agg_mode,
        cu_seqlens=inputs.cu_seqlens,
        loss_scale_factor=cfg.loss_scale_factor,
        global_num_tokens=inputs.global_num_tokens,
        global_num_seqs=inputs.global_num_seqs,
        premasked=True,
    )
    assert terms.clipped is not None
    return loss, terms.clipped


def _outputs(loss: torch.Tensor, metrics: dict[str, Metric]) -> LossOutputs:
    return LossOutputs(loss=loss, metrics=to_floats({"loss/value": loss.detach(), **metrics}))


def decoupled_ppo_loss(
    inputs: LossInputs, cfg: DecoupledPPOConfig | None = None, **kw: Any
) -> LossOutputs:
    """AReaL decoupled PPO: w = π_k/π_j^SGL, one-sided cap (`action="mask"`: w = 0 above `cap`,
    capped tokens stay in the denominator), truncation (`"clamp"`: min(w, cap)), or no weight
    at all (`None`, AReaL 1.0.4 with `rejection_sampling=None`). `behavior_logprobs` is unused.
    Settings: a `DecoupledPPOConfig`, or its fields as keywords (`cap=2.0, action="clamp"`)."""
    cfg = config_of(DecoupledPPOConfig, cfg, kw)
    base = dataclasses.replace(inputs, behavior_logprobs=None)
    if cfg.action is None:  # no behaviour weight: make π_k/π_j^SGL ≡ 1
        base = dataclasses.replace(base, rollout_logprobs=inputs.proximal_logprobs)
    compis_cfg = CompISConfig(
        **cfg.ppo_knobs(),
        staleness_method=cfg.method,
        staleness_low=0.0,
        staleness_high=cfg.cap,
        denom=Denom.KEEP,
    )
    out = compis_loss(base, compis_cfg)
    if cfg.action is None:  # no behaviour ratio at all: drop the (trivially 1) combined-ratio keys
        kept = {
            k: v
            for k, v in out.metrics.items()
            if not k.startswith(("is/combined", "is/weight", "loss/compis"))
        }
        return LossOutputs(loss=out.loss, metrics=kept)
    return out


def _single_ratio_weights(
    inputs: LossInputs, cfg: SingleRatioConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, denominator mask, dropped) of `single_ratio_loss`, detached."""
    mask, cu = inputs.loss_mask, inputs.cu_seqlens
    with torch.no_grad():
        d = safe_log_ratio(inputs.proximal_logprobs, inputs.rollout_logprobs)
        if cfg.level == "token":
            c = correct(d.exp(), cfg.method, cfg.low, cfg.high)
            w, dropped = torch.where(mask, c.weight, 0.0), c.masked & mask
        else:
            w = sequence_is_weights(
                d, mask, method=cfg.method, low=cfg.low, high=cfg.high, cu_seqlens=cu
            )
            dropped = mask & (w == 0) if cfg.method in (Method.CAP, Method.ICEPOP) else mask & False
        keep = mask
        if cfg.veto_threshold is not None:
            keep = keep & veto_mask(d, mask, threshold=cfg.veto_threshold, cu_seqlens=cu)
        if cfg.geo_low is not None and cfg.geo_high is not None:
            keep = keep & geometric_mask(d, mask, low=cfg.geo_low, high=cfg.geo_high, cu_seqlens=cu)
        w = torch.where(keep, w, 0.0)
        dropped = dropped | (mask & ~keep)
        if cfg.batch_normalize:
            w = batch_normalize(w, keep, level=cfg.level, cu_seqlens=cu)
        denom = mask & ~dropped if cfg.denom is Denom.DROP else mask
    return w, denom, dropped


def single_ratio_denominators_read_logprobs(cfg: SingleRatioConfig) -> bool:
    """Whether `single_ratio_denominators` under `cfg` depends on log-probs (`denom=drop`)."""
    return cfg.denom is Denom.DROP


def single_ratio_denominators(inputs: LossInputs, cfg: SingleRatioConfig) -> tuple[float, float]:
    """This micro-batch's (tokens, sequences) for the global denominators under `cfg.denom`."""
    _, denom, _ = _single_ratio_weights(inputs, cfg)
    return denominators(denom, cu_seqlens=inputs.cu_seqlens)


def single_ratio_loss(
    inputs: LossInputs, cfg: SingleRatioConfig | None = None, **kw: Any
) -> LossOutputs:
    """PPO on r1 weighted by one (token- or sequence-level) IS weight of π_k/π_j^SGL."""
    cfg = config_of(SingleRatioConfig, cfg, kw)
    w, denom, dropped = _single_ratio_weights(inputs, cfg)
    loss, _ = weighted_ppo(inputs, w, denom, cfg)
    if not cfg.diagnostics:
        return _outputs(loss, {})
    n = inputs.loss_mask.sum().clamp(min=1)
    return _outputs(
        loss, {"is/weight/mean": w.sum() / n, "is/weight/masked_frac": dropped.sum() / n}
    )


def m2po_mask(log_ratio: torch.Tensor, mask: torch.Tensor, *, tau: float = 0.04) -> torch.Tensor:
    """M2PO keep mask (paper + AReaL masking form, not the official adaptive-clip variant).

    Over all valid tokens, M2 = (log ρ)²; remove the fewest top-M2 tokens (stable descending
    sort, so among ties the last index survives) until the mean M2 of the rest is < `tau`;
    if no such count exists, keep exactly one token.
    """
    if not tau > 0:
        raise ValueError(f"tau={tau} must be > 0 (M2PO uses 0.04).")
    flat_mask = mask.reshape(-1)
    idx = flat_mask.nonzero().squeeze(1)
    keep = torch.zeros_like(flat_mask)
    n = idx.numel()
    if n == 0:
        return keep.reshape(mask.shape)
    d = torch.nan_to_num(
        log_ratio.detach().reshape(-1)[idx].double(), nan=0.0, posinf=0.0, neginf=0.0
    )
    m2 = d * d
    order = torch.sort(m2, descending=True, stable=True).indices
    sorted_m2 = m2[order]
    removed = torch.cat(
        [sorted_m2.new_zeros(1), torch.cumsum(sorted_m2, 0)[:-1]]
    )  # sum of top m, m = 0..n-1
    rest_mean = (sorted_m2.sum() - removed) / (
        n - torch.arange(n, dtype=torch.float64, device=d.device)
    )
    ok = (rest_mean < tau).nonzero()
    m = int(ok[0]) if ok.numel() else n - 1
    keep[idx[order[m:]]] = True
    return keep.reshape(mask.shape)


def m2po_loss(inputs: LossInputs, cfg: M2POConfig | None = None, **kw: Any) -> LossOutputs:
    """M2PO: mask tokens by second moment of log(π_k/π_j^SGL), then decoupled PPO with the
    behaviour weight (capped at `cap` if given) on the edited mask; masked tokens leave the
    denominator (`denom=drop`, as in AReaL)."""
    cfg = config_of(M2POConfig, cfg, kw)
    mask = inputs.loss_mask
    with torch.no_grad():
        d = safe_log_ratio(inputs.proximal_logprobs, inputs.rollout_logprobs)
        keep = m2po_mask(d, mask, tau=cfg.tau)
        w = d.exp() if cfg.cap is None else correct(d.exp(), Method.CAP, 0.0, cfg.cap).weight
        w = torch.where(keep, w, 0.0)
        m2 = torch.where(mask, d * d, 0.0)
    loss, _ = weighted_ppo(inputs, w, keep, cfg)
    if not cfg.diagnostics:
        return _outputs(loss, {})
    n, nk = mask.sum().clamp(min=1), keep.sum().clamp(min=1)
    return _outputs(
        loss,
        {
            "m2po/m2_before": m2.sum() / n,
            "m2po/m2_after": torch.where(keep, m2, 0.0).sum() / nk,
            "m2po/masked_frac": 1.0 - keep.sum() / n,
        },
    )


def gspo_loss(inputs: LossInputs, cfg: GSPOConfig | None = None, **kw: Any) -> LossOutputs:
    """GSPO as verl computes it (`compute_policy_loss_gspo`): log s_i = mean_t (lp_θ − lp_k)
    over the sequence's valid tokens (no per-token clamp; a non-finite Δ counts as 0), token form
    log s_i,t = sg(log s_i) + lp_θ,t − sg(lp_θ,t), clamped at `log_ratio_max` *after* that
    combination (so a sequence whose log-ratio reaches the clamp gets zero gradient, as in verl);
    L = max(−A·s, −A·clip(s, 1 − ε_low, 1 + ε_high)), seq-mean-token-mean."""
    cfg = config_of(GSPOConfig, cfg, kw)
    eps_low, eps_high = cfg.eps_low, cfg.eps_high
    mask, cu = inputs.loss_mask, inputs.cu_seqlens
    lp = upcast(inputs.logprobs)
    prox = upcast(inputs.proximal_logprobs.detach()).to(lp.dtype)
    d = torch.where(mask, (lp.detach() - prox).nan_to_num(0.0, 0.0, 0.0), 0.0)
    n = seq_sum(mask.to(d.dtype), cu)
    log_s = seq_sum(d, cu) / n.clamp(min=1)
    log_s_tok = (broadcast_seq(log_s, lp, cu) + (lp - lp.detach())).clamp(max=cfg.log_ratio_max)
    s_tok = torch.where(mask, log_s_tok, 0.0).exp()
    adv = torch.where(mask, inputs.advantages.detach().to(d.dtype), 0.0)
    per_tok = torch.maximum(-adv * s_tok, -adv * s_tok.clamp(1 - eps_low, 1 + eps_high))
    loss = aggregate(
        per_tok,
        mask,
        AggMode.SEQ_MEAN_TOKEN_MEAN,
        cu_seqlens=cu,
        global_num_seqs=inputs.global_num_seqs,
        premasked=False,
    )
    s = log_s.clamp(max=cfg.log_ratio_max).exp()
    valid = n > 0
    clip = ((s < 1 - eps_low) | (s > 1 + eps_high)) & valid
    return _outputs(
        loss,
        {
            **ratio_stats("is/gspo_seq", s[valid]),
            "policy/seq_clipfrac": clip.sum() / valid.sum().clamp(min=1),
        },
    )


def prime_masked_is_loss(
    inputs: LossInputs, cfg: PrimeMaskedISConfig | None = None, **kw: Any
) -> LossOutputs:
    """prime-rl (pre-IPO) masked IS: ρ_t = π_θ/π_infer; drop tokens outside [token_low,
    token_high], sequences whose geometric mean is outside [geo_low, geo_high] or with any ρ_t
    outside [seq_low, seq_high]; loss = −Σ_kept sg(ρ(A − τ·log ρ))·lp_θ / (all loss tokens).
    No PPO clip. The denominator is `global_num_tokens` when given."""
    c = config_of(PrimeMaskedISConfig, cfg, kw)
    mask, cu = inputs.loss_mask, inputs.cu_seqlens
    lp = inputs.logprobs
    with torch.no_grad():
        d = torch.where(mask, safe_log_ratio(lp.detach(), inputs.rollout_logprobs), 0.0)
        rho = d.exp()
        keep = mask & (rho >= c.token_low) & (rho <= c.token_high)
        keep = keep & geometric_mask(d, mask, low=c.geo_low, high=c.geo_high, cu_seqlens=cu)
        bad = mask & ((rho < c.seq_low) | (rho > c.seq_high))
        seq_bad = seq_sum(bad.to(d.dtype), cu) > 0
        keep = keep & ~broadcast_seq(seq_bad, mask, cu).bool()
        coef = torch.where(keep, rho * (inputs.advantages.detach().to(d.dtype) - c.kl_tau * d), 0.0)
    lp_safe = torch.where(keep, lp, 0.0)
    den = (
        inputs.global_num_tokens
        if inputs.global_num_tokens is not None
        else mask.sum().clamp(min=1)
    )
    loss = -(coef * lp_safe).sum() / den
    n = mask.sum().clamp(min=1)
    return _outputs(loss, {"is/weight/masked_frac": (mask & ~keep).sum() / n})
