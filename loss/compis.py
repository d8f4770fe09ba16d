"""CompIS: composable off-policy loss with the importance ratio split by source (docs/loss-spec.md §3).

Owns: `compis_loss`, `compis_terms` (per-token loss before reduction, used by the slime adapter)
and `compis_denominators` (a micro-batch's share of the global denominators, honouring
`denom=drop`). Must never import `slime_async`.

Per token:  r1 = π_θ/π_k (drift, PPO-clipped, the only ratio with gradient)
            r2 = π_j^Meg/π_j^SGL (engine mismatch)    r3 = π_k/π_j^Meg (staleness)
            L_t = f2(r2)·f3(r3) · PPO(r1, A)           loss = AGG(L, mask', mode)
Without π_j^Meg (`behavior_logprobs=None`) r2 and r3 cannot be separated: the combined ratio
r2·r3 = π_k/π_j^SGL is corrected by f3 alone (= AReaL's decoupled loss when f3 = cap 5), and
the metrics say so (`loss/compis_fallback = 1.0`).

Implementation (the hot path is a handful of float passes, no bool ops, which are slow on CPU):
the weight is built in log space under no_grad, one exp for f2·f3, masks as 0/1 float factors;
it is folded into the advantage (w ≥ 0 commutes with the PPO max/min), so the autograd graph is
exactly plain PPO's. Diagnostics (`loss.compis_metrics`) run on the valid tokens before masking.
"""

from __future__ import annotations

import dataclasses

import torch

from loss.aggregate import aggregate_premasked
from loss.compis_metrics import compis_metrics
from loss.corrections import clip_bounds, mask_excess
from loss.diagnostics import Metric, to_floats
from loss.ppo import ppo_from_neg_adv
from loss.ratios import segment_ids, seq_sum
from loss.types import CompISConfig, Denom, LossInputs, LossOutputs, Method, compute_dtype, upcast


@dataclasses.dataclass(frozen=True, slots=True)
class CompISTerms:
    """Per-token results of CompIS (all detached except `per_token_loss`)."""

    per_token_loss: torch.Tensor
    """w·PPO(r1, A); exactly 0 outside `loss_mask` and on tokens with w = 0."""
    mask: torch.Tensor
    """Effective denominator mask mask' as 0/1 floats (= loss_mask for denom=keep)."""
    weight: torch.Tensor
    """Final IS weight w = f2(r2)·f3(r3), 0 outside `loss_mask`."""
    valid_mask: torch.Tensor
    """`loss_mask` as 0/1 floats."""
    fallback: bool
    """True when behavior_logprobs was absent (combined ratio corrected by f3)."""


def _delta(num: torch.Tensor, den: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """num − den in `dtype` (upcast first), non-finite → 0; a fresh detached tensor."""
    return (upcast(num.detach()).to(dtype) - upcast(den.detach()).to(dtype)).nan_to_num_(
        0.0, 0.0, 0.0
    )


_BIG = 1e30  # log-weights pushed down by BIG·(distance past a bound) exp to exactly 0


def _log_weight(
    d: torch.Tensor, method: Method, low: float, high: float, clamp: float, *, keep: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """In place on the fresh Δ `d`: (clamped log w, 0/1 keep factor or None).

    The rule is `loss.corrections`' (in log space): `clip` clamps to `clip_bounds`; a masked
    token (`mask_excess` > 0) gets log w −= BIG·excess, so exp gives exactly 0 while tokens on
    a bound are untouched; a few float passes, no bool ops. The keep factor 1 − sign(excess)
    is built only when asked (`denom=drop`) and the method can mask.
    """
    if method is Method.CLIP:
        lo, hi = clip_bounds(low, high, log_space=True)
        return d.clamp_(max(lo, -clamp), min(hi, clamp)), None
    d.clamp_(-clamp, clamp)
    over = mask_excess(d, method, low, high, log_space=True)
    if over is None:
        return d, None
    keep_f = over.sign().neg_().add_(1.0) if keep else None
    return d.add_(over, alpha=-_BIG), keep_f


def _weights(
    inputs: LossInputs, cfg: CompISConfig, *, with_neg_adv: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(w, effective mask, valid mask, −A·w or None), all detached, shaped like the inputs."""
    dt = compute_dtype(
        inputs.logprobs, inputs.proximal_logprobs, inputs.rollout_logprobs, inputs.behavior_logprobs
    )
    clamp = cfg.log_ratio_clamp
    drop = cfg.denom is Denom.DROP
    with torch.no_grad():
        mask_f = inputs.loss_mask.to(dt)
        if inputs.behavior_logprobs is None:
            d3 = _delta(inputs.proximal_logprobs, inputs.rollout_logprobs, dt)
            keep2 = None
            logw, keep3 = _log_weight(
                d3, cfg.staleness_method, cfg.staleness_low, cfg.staleness_high, clamp, keep=drop
            )
        else:
            d2 = _delta(inputs.behavior_logprobs, inputs.rollout_logprobs, dt)
            d3 = _delta(inputs.proximal_logprobs, inputs.behavior_logprobs, dt)
            c2, keep2 = _log_weight(
                d2, cfg.engine_method, cfg.engine_low, cfg.engine_high, clamp, keep=drop
            )
            c3, keep3 = _log_weight(
                d3, cfg.staleness_method, cfg.staleness_low, cfg.staleness_high, clamp, keep=drop
            )
            logw = c2.add_(c3)
            del d3, c3
        w = logw.exp_().mul_(mask_f)
        eff = mask_f
        for keep in (keep2, keep3):
            if keep is not None:
                eff = eff * keep
        neg_adv = None
        if with_neg_adv:  # −A·w, NaN-safe: nan_to_num before the product (w is 0 off-mask)
            neg_adv = upcast(inputs.advantages.detach()).to(dt).nan_to_num(0.0, 0.0, 0.0)
            neg_adv.mul_(w).neg_()
    return w, eff, mask_f, neg_adv


def compis_weights(
    inputs: LossInputs, cfg: CompISConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w, effective mask, valid mask): the detached per-token weight f2(r2)·f3(r3) (0 outside
    `loss_mask`), the denominator mask under `cfg.denom` and `loss_mask`, masks as 0/1 floats
    in the compute dtype (fp64 if any log-prob input is fp64, else fp32)."""
    w, eff, mask_f, _ = _weights(inputs, cfg, with_neg_adv=False)
    return w, eff, mask_f


def compis_terms(inputs: LossInputs, cfg: CompISConfig) -> CompISTerms:
    """Per-token CompIS loss and weights (no reduction). Shapes follow `inputs.logprobs`."""
    w, eff, mask_f, neg_adv = _weights(inputs, cfg, with_neg_adv=True)
    assert neg_adv is not None
    ppo = ppo_from_neg_adv(
        inputs.logprobs,
        inputs.proximal_logprobs,
        neg_adv,
        cfg.eps_clip,
        cfg.eps_clip_high,
        cfg.dual_clip_c,
        log_ratio_clamp=cfg.log_ratio_clamp,
        with_clipped=False,
    )
    return CompISTerms(
        per_token_loss=ppo.loss,
        mask=eff,
        weight=w,
        valid_mask=mask_f,
        fallback=inputs.behavior_logprobs is None,
    )


def compis_denominators_read_logprobs(cfg: CompISConfig) -> bool:
    """Whether `compis_denominators` under `cfg` depends on log-probs: only `denom=drop` with a
    correction that can zero tokens (cap / icepop); otherwise its counts are `loss_mask`'s."""
    masking = (Method.CAP, Method.ICEPOP)
    return cfg.denom is Denom.DROP and (
        cfg.engine_method in masking or cfg.staleness_method in masking
    )


def compis_denominators(inputs: LossInputs, cfg: CompISConfig) -> tuple[float, float]:
    """This micro-batch's (tokens, sequences) for the global denominators under `cfg.denom`.

    Sum over all micro-batches and DP ranks, then pass as `global_num_tokens/global_num_seqs`.
    """
    _, eff, _ = compis_weights(inputs, cfg)
    counts = seq_sum(eff.to(torch.float64), inputs.cu_seqlens)
    return float(counts.sum()), float((counts > 0).sum())


def compis_loss(inputs: LossInputs, cfg: CompISConfig) -> LossOutputs:
    """CompIS loss of one micro-batch and its metrics (see module docstring, docs/loss-spec.md §3, §13).

    With `global_num_tokens`/`global_num_seqs` (from `compis_denominators`, summed over the
    mini-batch) the loss is this micro-batch's share: micro-batch losses add up exactly.
    """
    ids = (
        segment_ids(inputs.cu_seqlens, inputs.logprobs.shape[0])
        if inputs.cu_seqlens is not None
        else None
    )
    t = compis_terms(inputs, cfg)
    loss = aggregate_premasked(
        t.per_token_loss,
        t.mask,
        cfg.agg_mode,
        cu_seqlens=inputs.cu_seqlens,
        loss_scale_factor=cfg.loss_scale_factor,
        global_num_tokens=inputs.global_num_tokens,
        global_num_seqs=inputs.global_num_seqs,
        ids=ids,
    )
    metrics: dict[str, Metric] = {
        "loss/value": loss.detach(),
        "loss/compis_fallback": 1.0 if t.fallback else 0.0,
    }
    if cfg.diagnostics:
        with torch.no_grad():
            metrics["loss/num_tokens"] = (
                t.mask.sum() if cfg.denom is Denom.KEEP else inputs.loss_mask.sum()
            )
            metrics["loss/denom_tokens"] = (
                inputs.global_num_tokens if inputs.global_num_tokens is not None else t.mask.sum()
            )
            metrics.update(compis_metrics(inputs, cfg))
    return LossOutputs(loss=loss, metrics=to_floats(metrics))
