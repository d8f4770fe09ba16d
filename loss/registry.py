"""Losses by name, the dotted-path plugin hook, and the slime custom-loss adapter.

Owns: `register_loss`, `get_loss`, `get_loss_spec`, `available_losses`, `resolve_loss_spec`
(a registry name or a dotted path such as `--custom-loss-function-path my_pkg.losses.my_loss`),
`resolve_loss`, the built-in losses' specs, `compis_config_from_args`, `make_slime_loss` and
`slime_compis_loss`.

A loss is a `LossSpec` (`loss.spec`): `fn(inputs: LossInputs, cfg) -> LossOutputs`, the class
of `cfg` and the inputs the trainer must compute for it (`LossNeeds`). Built-ins:

| name | config class | reads | denominators |
|---|---|---|---|
| compis | `CompISConfig` | π_k, π_j^Meg, π_j^SGL | `compis_denominators` (denom=drop aware) |
| ppo | `PPOConfig` | π_k (+ π_j^SGL for diagnostics) | loss_mask counts |
| decoupled_ppo | `DecoupledPPOConfig` | π_k, π_j^SGL | loss_mask counts |
| single_ratio | `SingleRatioConfig` | π_k, π_j^SGL | `single_ratio_denominators` |
| m2po | `M2POConfig` | π_k, π_j^SGL | loss_mask counts |
| gspo | `GSPOConfig` | π_k | loss_mask counts |
| prime_masked_is | `PrimeMaskedISConfig` | π_j^SGL | loss_mask counts |

`register_loss(name, fn)` keeps working for a plain plugin `fn(inputs, cfg)`: it gets the
CompIS settings (`CompISConfig`) and reads everything CompIS reads, as before the seam existed;
pass `config_cls=` and `needs=` to declare less. A dotted path may name a `LossSpec` or a plain
function (treated the same way). For Python callers every built-in also accepts a
`CompISConfig` (the PPO knobs carry over; "decoupled_ppo" and "single_ratio" apply f3's method
and bounds to the combined ratio π_k/π_j^SGL) or a dict of its config's fields.

slime calling convention (its `loss_type=custom_loss` path): `fn(args, batch, logits,
sum_of_sample_mean) -> (loss, metrics)`, where `batch` holds per-sample lists (`advantages`,
`log_probs` = π_k, `rollout_log_probs`, `loss_masks`, `response_lengths`, `total_lengths`,
`unconcat_tokens`), `logits` is `[1, T, V]` packed, and `sum_of_sample_mean` is slime's
(CP-aware) reducer of a flat per-token tensor; slime then scales for micro-batches and DP.
`slime_compis_loss` plugs CompIS into it: `--custom-loss-function-path
loss.registry.slime_compis_loss`. Must never import `slime_async` (nor slime).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from loss.baseline_configs import (
    DecoupledPPOConfig,
    GSPOConfig,
    M2POConfig,
    PrimeMaskedISConfig,
    SingleRatioConfig,
)
from loss.baselines import (
    decoupled_ppo_loss,
    gspo_loss,
    m2po_loss,
    prime_masked_is_loss,
    single_ratio_denominators,
    single_ratio_loss,
)
from loss.compis import compis_denominators, compis_loss, compis_terms
from loss.compis_metrics import compis_metrics
from loss.named import Registry, load_function, load_object
from loss.spec import LossFn, LossNeeds, LossSpec
from loss.types import CompISConfig, LossInputs, LossOutputs, Method, PPOConfig, upcast

SlimeLossFn = Callable[
    [Any, dict, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]

_LOSSES: Registry[LossSpec] = Registry(
    "loss",
    hint=" or give a dotted path to your own function (e.g. my_pkg.losses.my_loss)",
)

PLUGIN_NEEDS = LossNeeds(
    proximal_logprobs=True, behavior_logprobs=True, denominators=compis_denominators
)
"""What a plain plugin `fn(inputs, cfg)` is given: everything CompIS reads."""

_DEFAULT = object()


def register_loss(
    name: str,
    fn: LossFn | None = None,
    *,
    config_cls: type | None = _DEFAULT,  # type: ignore[assignment]
    needs: LossNeeds | None = None,
    replace: bool = False,
) -> Any:
    """Register `fn` under `name` (usable as a decorator: `@register_loss("mine")`).

    `config_cls`: the dataclass of its settings (default `CompISConfig`, as for every plugin
    before declared configs existed; None = no settings). `needs`: the inputs it reads
    (default `PLUGIN_NEEDS`, everything CompIS reads)."""
    cls = CompISConfig if config_cls is _DEFAULT else config_cls

    def add(f: LossFn) -> LossFn:
        spec = LossSpec(name=name, fn=f, config_cls=cls, needs=needs or PLUGIN_NEEDS)
        _LOSSES.register(name, spec, replace=replace)
        return f

    return add if fn is None else add(fn)


def available_losses() -> list[str]:
    """Registered loss names, sorted."""
    return _LOSSES.names()


def get_loss_spec(name: str) -> LossSpec:
    """The `LossSpec` registered as `name`; unknown names raise ValueError listing the choices."""
    return _LOSSES.get(name)


def get_loss(name: str) -> LossFn:
    """The loss function registered as `name` (see `get_loss_spec` for its config and needs)."""
    return get_loss_spec(name).fn


def resolve_loss_spec(name_or_path: str) -> LossSpec:
    """A registered name, else a dotted path to a `LossSpec` or to a plain plugin function
    `fn(inputs, cfg) -> LossOutputs` (which gets `CompISConfig` and `PLUGIN_NEEDS`)."""
    if name_or_path in _LOSSES:
        return _LOSSES.get(name_or_path)
    if "." not in name_or_path and ":" not in name_or_path:
        return _LOSSES.get(name_or_path)
    obj = load_object(name_or_path)
    if isinstance(obj, LossSpec):
        return obj
    fn = load_function(name_or_path)
    return LossSpec(name=name_or_path, fn=fn, config_cls=CompISConfig, needs=PLUGIN_NEEDS)


def resolve_loss(name_or_path: str) -> LossFn:
    """The function of `resolve_loss_spec(name_or_path)`."""
    return resolve_loss_spec(name_or_path).fn


# ---------------------------------------------------------------------------------- built-ins


def _native(name: str, cls: type, from_compis: Callable[[CompISConfig], Any]) -> Callable:
    """cfg → an instance of `cls`: as given, its defaults (None), from a dict of its fields, or
    mapped from a `CompISConfig` (a Python caller holding one config can switch losses)."""

    def convert(cfg: Any) -> Any:
        if cfg is None or isinstance(cfg, cls):
            return cfg
        if isinstance(cfg, CompISConfig):
            return from_compis(cfg)
        if isinstance(cfg, dict):
            return cls(**cfg)
        raise ValueError(
            f"loss {name!r} takes a {cls.__name__} (or a CompISConfig, a dict of its fields, or "
            f"None), got {type(cfg).__name__}."
        )

    return convert


_ACTIONS = {Method.CAP: "mask", Method.CLIP: "clamp", Method.NONE: None}


def _decoupled_from(cfg: CompISConfig) -> DecoupledPPOConfig:
    """AReaL decoupled PPO from CompIS knobs: f3's method/upper bound on the combined ratio."""
    if cfg.staleness_method not in _ACTIONS:
        raise ValueError(
            f"decoupled_ppo supports staleness_method cap/clip/none, got {cfg.staleness_method!r}."
        )
    return DecoupledPPOConfig(
        **cfg.ppo_knobs(), cap=cfg.staleness_high, action=_ACTIONS[cfg.staleness_method]
    )


def _single_from(cfg: CompISConfig) -> SingleRatioConfig:
    """Token-level single ratio from CompIS knobs: f3 applied to the combined ratio."""
    return SingleRatioConfig(
        **cfg.ppo_knobs(),
        method=cfg.staleness_method,
        low=cfg.staleness_low,
        high=cfg.staleness_high,
        denom=cfg.denom,
    )


def _ppo_loss(inputs: LossInputs, cfg: PPOConfig | None = None) -> LossOutputs:
    """Plain PPO on r1 (no behaviour weight). With diagnostics on it still reports the
    off-policy sources it is given (r1 drift, the combined π_k/π_j^SGL, train/rollout
    mismatch; r2/r3 only when π_j^Meg is passed), so an uncorrected run shows what it leaves
    uncorrected; `is/weight/*` is omitted (no weight). The bounds the diagnostics compare
    against are CompIS's (its defaults for a plain `PPOConfig`)."""
    cfg = cfg or PPOConfig()
    out = decoupled_ppo_loss(inputs, DecoupledPPOConfig(**cfg.ppo_knobs(), action=None))
    if not cfg.diagnostics:
        return out
    diag = cfg if isinstance(cfg, CompISConfig) else CompISConfig(**cfg.ppo_knobs())
    extra = {k: float(v) for k, v in compis_metrics(inputs, diag).items()
             if not k.startswith(("is/weight/", "loss/"))}  # fmt: skip
    return dataclasses.replace(out, metrics={**out.metrics, **extra})


def _builtin(
    name: str,
    loss: Callable[[LossInputs, Any], LossOutputs],
    cls: type,
    needs: LossNeeds,
    from_compis: Callable[[CompISConfig], Any],
) -> None:
    convert = _native(name, cls, from_compis)

    def fn(inputs: LossInputs, cfg: Any = None) -> LossOutputs:
        return loss(inputs, convert(cfg))

    fn.__name__ = fn.__qualname__ = f"{name}_loss"
    _LOSSES.register(name, LossSpec(name=name, fn=fn, config_cls=cls, needs=needs))


_PI_K_AND_SGL = LossNeeds(proximal_logprobs=True, rollout_logprobs=True)
_BUILTINS: list[tuple[str, Callable, type, LossNeeds, Callable[[CompISConfig], Any]]] = [
    ("compis", lambda i, c: compis_loss(i, c or CompISConfig()), CompISConfig, PLUGIN_NEEDS,
     lambda c: c),
    ("ppo", _ppo_loss, PPOConfig, _PI_K_AND_SGL, lambda c: c),
    ("decoupled_ppo", decoupled_ppo_loss, DecoupledPPOConfig, _PI_K_AND_SGL, _decoupled_from),
    ("single_ratio", single_ratio_loss, SingleRatioConfig,
     dataclasses.replace(_PI_K_AND_SGL, denominators=single_ratio_denominators), _single_from),
    ("m2po", m2po_loss, M2POConfig, _PI_K_AND_SGL, lambda c: M2POConfig(**c.ppo_knobs())),
    ("gspo", gspo_loss, GSPOConfig, LossNeeds(rollout_logprobs=False), lambda c: None),
    ("prime_masked_is", prime_masked_is_loss, PrimeMaskedISConfig,
     LossNeeds(proximal_logprobs=False), lambda c: None),
]  # fmt: skip
for _args in _BUILTINS:
    _builtin(*_args)


# ---------------------------------------------------------------------------------- slime adapter


def compis_config_from_args(args: Any) -> CompISConfig:
    """CompISConfig from a slime-style namespace: `eps_clip`, `eps_clip_high`, `eps_clip_c`
    (dual clip), plus any `compis_<field>` attribute (e.g. `compis_engine_method`)."""
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


def response_logprobs(
    logits: torch.Tensor,
    *,
    unconcat_tokens: Sequence[torch.Tensor],
    total_lengths: Sequence[int],
    response_lengths: Sequence[int],
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Per-sample response-token log-probs from packed `[1, T, V]` logits (no context
    parallelism): logits at position p score token p + 1. Returns tensors `[R_i]` (bf16/fp16
    logits are upcast to fp32 first)."""
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"expected packed logits [1, T, V], got {tuple(logits.shape)}.")
    out, offset = [], 0
    for tokens, total, resp in zip(unconcat_tokens, total_lengths, response_lengths):
        seg = upcast(logits[0, offset + total - resp - 1 : offset + total - 1]) / temperature
        tgt = tokens[total - resp : total].to(seg.device).long()
        out.append(torch.log_softmax(seg, dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1))
        offset += total
    return out


def make_slime_loss(
    cfg: CompISConfig | None = None,
    *,
    logprob_fn: Callable[..., list[torch.Tensor]] | None = None,
    behavior_key: str = "behavior_log_probs",
) -> SlimeLossFn:
    """A slime custom loss running CompIS. `cfg=None` reads it from `args` each call
    (`compis_config_from_args`). `logprob_fn(logits, args=, batch=)` returns the per-sample
    response log-probs with grad (default: `response_logprobs`, CP = 1; pass a wrapper around
    slime's own helper for context parallelism). π_j^Meg is read from `batch[behavior_key]`
    when present, else CompIS falls back to the combined ratio. Denominators are slime's
    (its reducer), so `agg_mode`/`denom` of `cfg` do not apply here."""

    def slime_loss(
        args: Any, batch: dict, logits: torch.Tensor, sum_of_sample_mean: Callable
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = cfg or compis_config_from_args(args)
        if logprob_fn is None:
            lps = response_logprobs(
                logits,
                unconcat_tokens=batch["unconcat_tokens"],
                total_lengths=batch["total_lengths"],
                response_lengths=batch["response_lengths"],
                temperature=float(getattr(args, "rollout_temperature", 1.0) or 1.0),
            )
        else:
            lps = logprob_fn(logits, args=args, batch=batch)
        lp = torch.cat(lps)
        dev = lp.device

        def cat(key: str) -> torch.Tensor:
            return torch.cat([torch.as_tensor(x).to(dev) for x in batch[key]])

        lengths = torch.tensor([int(x.numel()) for x in lps])
        behavior = batch.get(behavior_key)
        inputs = LossInputs(
            logprobs=lp,
            proximal_logprobs=cat("log_probs").detach(),
            rollout_logprobs=cat("rollout_log_probs").detach(),
            behavior_logprobs=cat(behavior_key).detach() if behavior is not None else None,
            advantages=cat("advantages"),
            loss_mask=cat("loss_masks").bool(),
            cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(dev),
        )
        terms = compis_terms(inputs, c)
        loss = sum_of_sample_mean(terms.per_token_loss)
        metrics: dict[str, torch.Tensor] = {
            "pg_loss": loss.detach(),
            "compis_fallback": torch.tensor(1.0 if terms.fallback else 0.0, device=dev),
        }
        if c.diagnostics:
            with torch.no_grad():
                for k, v in compis_metrics(inputs, c).items():
                    metrics[k] = (
                        v.detach().to(dev, torch.float32)
                        if isinstance(v, torch.Tensor)
                        else torch.tensor(v, device=dev)
                    )
        return loss, metrics

    return slime_loss


def slime_compis_loss(
    args: Any, batch: dict, logits: torch.Tensor, sum_of_sample_mean: Callable
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`--custom-loss-function-path loss.registry.slime_compis_loss`: CompIS configured from
    slime's args (`eps_clip`, `eps_clip_high`, `eps_clip_c`, `compis_*`)."""
    return make_slime_loss()(args, batch, logits, sum_of_sample_mean)
