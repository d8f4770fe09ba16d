"""CompIS as a slime custom loss: `--loss-type custom_loss --custom-loss-function-path
loss.registry.slime_compis_loss`.

Owns: `make_slime_loss`, `slime_compis_loss`, `compis_config_from_args`, `response_logprobs` and
`SLIME_METRIC_KEYS`. Must never import `slime_async` (nor slime); megatron-core only lazily,
through `loss.vocab_parallel`, for tensor parallelism.

slime's contract (`slime/backends/megatron_utils/loss.py`, `loss_type == "custom_loss"`):
`fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)` per micro-batch, where

* `logits` is `[1, T, V/TP]` packed: with tensor parallelism each rank holds one vocabulary shard
  (the adapter computes log-probs across the TP group, `loss.vocab_parallel`);
* `batch` holds per-sample lists: `unconcat_tokens`, `total_lengths`, `response_lengths`,
  `loss_masks`, `advantages`, `rollout_log_probs`, and `log_probs` (π_k) unless slime ran with
  `--use-rollout-logprobs`; `ref_log_probs` with `--use-kl-loss`;
* `sum_of_sample_mean(x)` reduces a flat per-token tensor: Σ over samples of the masked mean
  (or the masked token sum with `--calculate-per-token-loss`);
* every returned metric is a scalar tensor that slime SUMS over micro-batches and DP ranks and
  then divides by the step's sample count (or token count with `--calculate-per-token-loss`).

So each metric here is `sum_of_sample_mean(per-token value)`: after slime's reduction it is
exactly the per-sample mean (per-token mean) of that value over the step, on every micro-batch
split and DP size. Statistics that are not additive (quantiles, min/max, std, ESS, χ²) are not
returned; our own trainer reports them. `SLIME_METRIC_KEYS` lists the keys: always the same set
for a given `args`, also for a micro-batch whose tokens are all masked (slime's reducer needs
one key list for the whole step).

Without `log_probs` in the batch (`--use-rollout-logprobs`, where slime skips the π_k forward)
π_k is the detached training forward: exact when a rollout feeds one optimizer step (slime's
default `--num-steps-per-rollout 1`: every micro-batch of the step sees the same weights); with
several steps per rollout r1 is then 1 and the drift since the rollout is corrected by f3 as
staleness, not PPO-clipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from loss.compis import compis_terms
from loss.kl import kl_penalty
from loss.ratios import safe_log_ratio
from loss.types import CompISConfig, LossInputs
from loss.vocab_parallel import megatron_cp_size, megatron_tp_group, vocab_parallel_logprobs

SlimeLossFn = Callable[
    [Any, dict, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]

_SOURCE_KEYS = ("mean", "frac_above_high", "frac_below_low", "kl_k3")
SLIME_METRIC_KEYS: tuple[str, ...] = (
    "loss",
    "pg_loss",
    "pg_clipfrac",
    "ppo_kl",
    "train_rollout_logprob_abs_diff",
    "compis/fallback_frac",
    "is/drift/mean",
    *(f"is/{s}/{k}" for s in ("engine", "staleness", "combined") for k in _SOURCE_KEYS),
    "is/weight/mean",
    "is/weight/masked_frac",
    "policy/advantage_mean",
)
"""Metric keys the adapter always returns (plus `entropy_loss` when `args.entropy_coef != 0`
and `kl_loss` with `args.use_kl_loss`). Each is exact under slime's reducer: a per-sample mean
over the step (per-token mean with `--calculate-per-token-loss`). `is/engine/*` and
`is/staleness/*` are 0 on samples trained without π_j^Meg; `compis/fallback_frac` is that
share, so their mean over the samples that had π_j^Meg is value / (1 − fallback_frac)."""

_REFUSED = {
    "use_tis": "CompIS corrects the engine ratio itself (default clip(0, 2), slime's TIS); set "
    "compis_engine_method/compis_engine_low/compis_engine_high in --custom-config-path instead",
    "use_opsm": "OPSM is part of slime's built-in policy loss, which a custom loss replaces",
}


def compis_config_from_args(args: Any) -> CompISConfig:
    """CompISConfig from a slime-style namespace: `eps_clip`, `eps_clip_high`, `eps_clip_c`
    (dual clip), plus any `compis_<field>` attribute (e.g. `compis_engine_method`; slime sets
    such attributes from the YAML of `--custom-config-path`)."""
    kw: dict[str, Any] = {}
    if getattr(args, "eps_clip", None) is not None:
        kw["eps_clip"] = args.eps_clip
    if getattr(args, "eps_clip_high", None) is not None:
        kw["eps_clip_high"] = args.eps_clip_high
    elif "eps_clip" in kw:
        kw["eps_clip_high"] = kw["eps_clip"]
    if getattr(args, "eps_clip_c", None) is not None:
        kw["dual_clip_c"] = args.eps_clip_c
    for f in dataclasses.fields(CompISConfig):
        v = getattr(args, f"compis_{f.name}", None)
        if v is not None:
            kw[f.name] = v
    return CompISConfig(**kw)


def _check_args(args: Any) -> None:
    """Refuse slime flags whose effect a custom loss would silently drop."""
    errors = [
        f"--{k.replace('_', '-')}: {why}" for k, why in _REFUSED.items() if getattr(args, k, False)
    ]
    est = getattr(args, "advantage_estimator", None)
    if est in ("gspo", "cispo"):
        errors.append(
            f"--advantage-estimator {est} switches slime's built-in loss to {est.upper()}, which "
            "a custom loss replaces; use grpo (CompIS is token-level PPO with IS corrections)"
        )
    if megatron_cp_size() > 1:
        errors.append(
            "context parallelism: the default log-prob path is CP = 1; pass "
            "make_slime_loss(logprob_fn=...) wrapping slime's get_log_probs_and_entropy"
        )
    if errors:
        raise ValueError("slime_compis_loss cannot honour:\n  - " + "\n  - ".join(errors))


def response_logprobs(
    logits: torch.Tensor,
    *,
    unconcat_tokens: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    temperature: float = 1.0,
    tp_group: Any | None = None,
    with_entropy: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample response-token (log-probs, entropies or None) from packed `[1, T, V_local]`
    logits (no context parallelism): logits at position p score token p + 1. `tp_group`: the
    tensor-parallel group when the logits are one vocabulary shard (`loss.vocab_parallel`).
    Returns tensors `[R_i]` in fp32 (fp64 for fp64 logits)."""
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"expected packed logits [1, T, V], got {tuple(logits.shape)}.")
    rows, targets, offset = [], [], 0
    for tokens, total, resp in zip(unconcat_tokens, total_lengths, response_lengths):
        rows.append(torch.arange(offset + total - resp - 1, offset + total - 1))
        targets.append(torch.as_tensor(tokens)[total - resp : total])
        offset += total
    if offset > logits.shape[1]:
        raise ValueError(f"the samples span {offset} positions but logits have {logits.shape[1]}.")
    idx = torch.cat(rows).to(logits.device) if rows else torch.zeros(0, dtype=torch.long)
    seg = logits[0].index_select(0, idx)
    if temperature != 1.0:
        seg = seg / temperature
    tgt = torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long)
    lp, ent = vocab_parallel_logprobs(seg, tgt, group=tp_group, with_entropy=with_entropy)
    sizes = [int(r) for r in response_lengths]
    return list(lp.split(sizes)), (list(ent.split(sizes)) if ent is not None else None)


def make_slime_loss(
    cfg: CompISConfig | None = None,
    *,
    logprob_fn: Callable[..., list[torch.Tensor]] | None = None,
    behavior_key: str = "behavior_log_probs",
    tp_group: Any | None = None,
) -> SlimeLossFn:
    """A slime custom loss running CompIS. `cfg=None` reads it from `args` on each call
    (`compis_config_from_args`). `logprob_fn(logits, args=, batch=)` returns the per-sample
    response log-probs with grad (default: `response_logprobs` over `tp_group`, else
    megatron-core's TP group when initialised; CP = 1). π_j^Meg is read from
    `batch[behavior_key]` when present, else CompIS falls back to the combined ratio. slime's
    reducer sets the denominators, so `agg_mode`/`denom` of `cfg` do not apply here."""

    def slime_loss(
        args: Any, batch: dict, logits: torch.Tensor, sum_of_sample_mean: Callable
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _check_args(args)
        c = cfg or compis_config_from_args(args)
        entropy_coef = float(getattr(args, "entropy_coef", 0.0) or 0.0)
        if logprob_fn is None:
            lps, ents = response_logprobs(
                logits,
                unconcat_tokens=batch["unconcat_tokens"],
                total_lengths=batch["total_lengths"],
                response_lengths=batch["response_lengths"],
                temperature=float(getattr(args, "rollout_temperature", 1.0) or 1.0),
                tp_group=tp_group if tp_group is not None else megatron_tp_group(),
                with_entropy=entropy_coef != 0.0,
            )
        else:
            if entropy_coef != 0.0:
                raise ValueError("entropy_coef != 0 needs the adapter's own log-prob path")
            lps, ents = logprob_fn(logits, args=args, batch=batch), None
        inputs = _loss_inputs(lps, batch, behavior_key=behavior_key)
        terms = compis_terms(inputs, c)
        pg_loss = sum_of_sample_mean(terms.per_token_loss)
        extra = _regularizers(args, inputs, batch, ents, entropy_coef, sum_of_sample_mean)
        loss = pg_loss
        if "entropy_loss" in extra:
            loss = loss - entropy_coef * extra["entropy_loss"]
        if "kl_loss" in extra:
            loss = loss + float(args.kl_loss_coef) * extra["kl_loss"]
        if inputs.logprobs.numel() == 0:  # keep the graph connected (slime does the same)
            loss = loss + 0 * logits.sum()
        with torch.no_grad():
            metrics = _metrics(inputs, c, terms.weight, sum_of_sample_mean)
            metrics["loss"], metrics["pg_loss"] = loss.detach(), pg_loss.detach()
            metrics.update({k: v.detach() for k, v in extra.items()})
        return loss, {k: metrics[k] for k in (*SLIME_METRIC_KEYS, *extra)}

    return slime_loss


def _cat(batch: dict, key: str, device: torch.device) -> torch.Tensor:
    """slime's per-sample list `batch[key]`, packed `[N]` on `device`, without grad."""
    return torch.cat([torch.as_tensor(x).to(device) for x in batch[key]]).detach()


def _loss_inputs(lps: Sequence[torch.Tensor], batch: dict, *, behavior_key: str) -> LossInputs:
    """CompIS inputs from the per-sample response log-probs `lps` (with grad) and slime's
    batch: proximal = slime's `log_probs` (else the detached current ones), π_j^Meg from
    `behavior_key` when present, one packed sequence per sample."""
    lp = torch.cat(lps)
    dev = lp.device
    lengths = torch.tensor([int(x.numel()) for x in lps])
    prox = _cat(batch, "log_probs", dev) if batch.get("log_probs") else lp.detach()
    behavior = _cat(batch, behavior_key, dev) if batch.get(behavior_key) else None
    return LossInputs(
        logprobs=lp,
        proximal_logprobs=prox,
        rollout_logprobs=_cat(batch, "rollout_log_probs", dev),
        behavior_logprobs=behavior,
        advantages=_cat(batch, "advantages", dev),
        loss_mask=_cat(batch, "loss_masks", dev).bool(),
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(dev),
    )


def _regularizers(
    args: Any,
    inputs: LossInputs,
    batch: dict,
    ents: list[torch.Tensor] | None,
    entropy_coef: float,
    reduce: Callable,
) -> dict[str, torch.Tensor]:
    """slime's optional loss terms, reduced: `entropy_loss` (`--entropy-coef` != 0) and `kl_loss` against the reference (`--use-kl-loss`, importance
    weighted with `--use-unbiased-kl`)."""
    extra: dict[str, torch.Tensor] = {}
    if entropy_coef != 0.0:
        assert ents is not None
        extra["entropy_loss"] = reduce(torch.cat(ents))
    if getattr(args, "use_kl_loss", False):
        lp = inputs.logprobs
        ref = _cat(batch, "ref_log_probs", lp.device)
        kl = kl_penalty(lp, ref, getattr(args, "kl_loss_type", "low_var_kl"))
        if getattr(args, "use_unbiased_kl", False):
            kl = kl * safe_log_ratio(lp, inputs.proximal_logprobs).exp()
        extra["kl_loss"] = reduce(kl)
    return extra


def _metrics(
    inputs: LossInputs, cfg: CompISConfig, weight: torch.Tensor, reduce: Callable
) -> dict[str, torch.Tensor]:
    """Every `SLIME_METRIC_KEYS` metric as `reduce(per-token value)` (additive over micro-batches)."""
    lp, prox, roll = inputs.logprobs.detach(), inputs.proximal_logprobs, inputs.rollout_logprobs
    d1 = safe_log_ratio(lp, prox)
    adv = torch.nan_to_num(inputs.advantages.to(d1.dtype))
    r1 = d1.exp()
    clipped = ((adv > 0) & (r1 > 1 + cfg.eps_clip_high)) | ((adv < 0) & (r1 < 1 - cfg.eps_clip))
    out = {
        "pg_clipfrac": reduce(clipped.to(d1.dtype)),
        "ppo_kl": reduce(-d1),
        "train_rollout_logprob_abs_diff": reduce((prox - roll).abs().to(d1.dtype)),
        "is/drift/mean": reduce(r1),
        "is/weight/mean": reduce(weight.to(d1.dtype)),
        "is/weight/masked_frac": reduce((weight == 0).to(d1.dtype)),
        "policy/advantage_mean": reduce(adv),
    }
    fallback = inputs.behavior_logprobs is None
    out["compis/fallback_frac"] = reduce(torch.full_like(d1, 1.0 if fallback else 0.0))
    sources = {"combined": (safe_log_ratio(prox, roll), cfg.staleness_low, cfg.staleness_high)}
    if not fallback:
        beh = inputs.behavior_logprobs
        sources["engine"] = (safe_log_ratio(beh, roll), cfg.engine_low, cfg.engine_high)
        sources["staleness"] = (safe_log_ratio(prox, beh), cfg.staleness_low, cfg.staleness_high)
    zero = torch.zeros_like(d1)
    for name in ("engine", "staleness", "combined"):
        d, low, high = sources.get(name, (None, 0.0, 0.0))
        r = d.to(d1.dtype).exp() if d is not None else None
        vals = {
            "mean": r,
            "frac_above_high": None if r is None else (r > high).to(d1.dtype),
            "frac_below_low": None if r is None else (r < low).to(d1.dtype),
            "kl_k3": None if d is None else torch.expm1(d.to(d1.dtype)) - d.to(d1.dtype),
        }
        for k, v in vals.items():
            out[f"is/{name}/{k}"] = reduce(zero if v is None else v)
    return out


def slime_compis_loss(
    args: Any, batch: dict, logits: torch.Tensor, sum_of_sample_mean: Callable
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`--custom-loss-function-path loss.registry.slime_compis_loss`: CompIS configured from
    slime's args (`eps_clip`, `eps_clip_high`, `eps_clip_c`, `compis_*`), plus slime's
    `entropy_coef` and `use_kl_loss`/`kl_loss_coef`/`kl_loss_type` terms."""
    return make_slime_loss()(args, batch, logits, sum_of_sample_mean)
