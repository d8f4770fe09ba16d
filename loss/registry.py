"""Losses by name, the dotted-path plugin hook, and the slime custom-loss adapter.

Owns: `register_loss`, `get_loss`, `available_losses`, `load_function`, `resolve_loss`
(a registry name or a dotted path such as `--custom-loss-function-path my_pkg.losses.my_loss`),
`compis_config_from_args`, `make_slime_loss` and `slime_compis_loss`.

A registered loss is `fn(inputs: LossInputs, cfg=None) -> LossOutputs`. Every named loss
accepts a `CompISConfig` (so a trainer holding one config can switch losses by name: the PPO
knobs carry over; "decoupled_ppo" and "single_ratio" apply f3's method and bounds to the
combined ratio π_k/π_j^SGL; "gspo" and "prime_masked_is" keep their own defaults), and also its
native config: a `SingleRatioConfig` for "single_ratio", a dict of keyword arguments for
"decoupled_ppo", "m2po", "gspo", "prime_masked_is". A plugin loaded by path must accept the same call `fn(inputs, cfg)`;
loading checks that the path imports and names a callable.

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
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from loss.baselines import (
    SingleRatioConfig,
    decoupled_ppo_loss,
    gspo_loss,
    m2po_loss,
    prime_masked_is_loss,
    single_ratio_loss,
)
from loss.compis import compis_loss, compis_terms
from loss.compis_metrics import compis_metrics
from loss.types import CompISConfig, LossInputs, LossOutputs, Method, upcast

LossFn = Callable[..., LossOutputs]
SlimeLossFn = Callable[
    [Any, dict, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]

_REGISTRY: dict[str, LossFn] = {}


def register_loss(name: str, fn: LossFn | None = None, *, replace: bool = False) -> Any:
    """Register `fn` under `name` (usable as a decorator: `@register_loss("mine")`)."""

    def add(f: LossFn) -> LossFn:
        if not callable(f):
            raise ValueError(f"loss {name!r} must be callable, got {type(f).__name__}.")
        if name in _REGISTRY and not replace:
            raise ValueError(
                f"loss {name!r} is already registered; pick another name or pass replace=True."
            )
        _REGISTRY[name] = f
        return f

    return add if fn is None else add(fn)


def available_losses() -> list[str]:
    """Registered loss names, sorted."""
    return sorted(_REGISTRY)


def get_loss(name: str) -> LossFn:
    """The loss registered as `name`; unknown names raise ValueError listing the choices."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown loss {name!r}; choose one of {', '.join(available_losses())} or give a "
            f"dotted path to your own function (e.g. my_pkg.losses.my_loss)."
        ) from None


def load_function(path: str) -> Callable[..., Any]:
    """Import `pkg.module.attr` (or `pkg.module:attr`) and return it; clear errors otherwise."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError("the function path is empty; give it as pkg.module.function.")
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path; give it as pkg.module.function.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"cannot import module {module_name!r} for {path!r} ({e}); make sure it is on PYTHONPATH."
        ) from e
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(
            f"module {module_name!r} has no attribute {attr!r} (from {path!r})."
        ) from None
    if not callable(fn):
        raise ValueError(f"{path!r} is a {type(fn).__name__}, not a function.")
    return fn


def resolve_loss(name_or_path: str) -> LossFn:
    """A registered name, else a dotted path to a plugin `fn(inputs, cfg) -> LossOutputs`."""
    if name_or_path in _REGISTRY:
        return _REGISTRY[name_or_path]
    if "." in name_or_path or ":" in name_or_path:
        return load_function(name_or_path)
    return get_loss(name_or_path)


def _ppo_kw(cfg: CompISConfig) -> dict[str, Any]:
    return {
        "eps_clip": cfg.eps_clip,
        "eps_clip_high": cfg.eps_clip_high,
        "agg_mode": cfg.agg_mode,
        "loss_scale_factor": cfg.loss_scale_factor,
    }


def _kwargs(cfg: Any, from_compis: Callable[[CompISConfig], dict[str, Any]]) -> dict[str, Any]:
    """A keyword-style baseline's kwargs: a dict as given, or mapped from a CompISConfig (so a
    trainer holding one config can switch losses by name)."""
    if cfg is None:
        return {}
    if isinstance(cfg, CompISConfig):
        return from_compis(cfg)
    if isinstance(cfg, dict):
        return cfg
    raise ValueError(
        f"expected a CompISConfig, a dict of keyword arguments or None, got {type(cfg).__name__}."
    )


_ACTIONS = {Method.CAP: "mask", Method.CLIP: "clamp", Method.NONE: None}


def _decoupled_from(cfg: CompISConfig) -> dict[str, Any]:
    """AReaL decoupled PPO from CompIS knobs: f3's method/upper bound on the combined ratio."""
    if cfg.staleness_method not in _ACTIONS:
        raise ValueError(
            f"decoupled_ppo supports staleness_method cap/clip/none, got {cfg.staleness_method!r}."
        )
    return {
        **_ppo_kw(cfg),
        "cap": cfg.staleness_high,
        "action": _ACTIONS[cfg.staleness_method],
        "dual_clip_c": cfg.dual_clip_c,
        "diagnostics": cfg.diagnostics,
    }


def _single_from(cfg: CompISConfig) -> SingleRatioConfig:
    """Token-level single ratio from CompIS knobs: f3 applied to the combined ratio."""
    return SingleRatioConfig(
        method=cfg.staleness_method,
        low=cfg.staleness_low,
        high=cfg.staleness_high,
        eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high,
        dual_clip_c=cfg.dual_clip_c,
        agg_mode=cfg.agg_mode,
        loss_scale_factor=cfg.loss_scale_factor,
        denom=cfg.denom,
    )


def _ppo_loss(inputs: LossInputs, cfg: CompISConfig | None = None) -> LossOutputs:
    """Plain PPO on r1 (no behaviour weight), the same knobs as CompIS. With diagnostics on it
    still reports every off-policy source (r1/r2/r3 statistics, train/rollout mismatch), so an
    uncorrected run shows what it leaves uncorrected; `is/weight/*` is omitted (no weight)."""
    cfg = cfg or CompISConfig()
    kw = {**_decoupled_from(dataclasses.replace(cfg, staleness_method="cap")), "action": None}
    out = decoupled_ppo_loss(inputs, **kw)
    if not cfg.diagnostics:
        return out
    extra = {k: float(v) for k, v in compis_metrics(inputs, cfg).items()
             if not k.startswith(("is/weight/", "loss/"))}  # fmt: skip
    return dataclasses.replace(out, metrics={**out.metrics, **extra})


def _single(inputs: LossInputs, cfg: Any = None) -> LossOutputs:
    if isinstance(cfg, CompISConfig):
        cfg = _single_from(cfg)
    return single_ratio_loss(inputs, cfg or SingleRatioConfig())


register_loss("compis", lambda inputs, cfg=None: compis_loss(inputs, cfg or CompISConfig()))
register_loss("ppo", _ppo_loss)
register_loss(
    "decoupled_ppo",
    lambda inputs, cfg=None: decoupled_ppo_loss(inputs, **_kwargs(cfg, _decoupled_from)),
)
register_loss("single_ratio", _single)
register_loss("m2po", lambda inputs, cfg=None: m2po_loss(inputs, **_kwargs(cfg, _ppo_kw)))
register_loss("gspo", lambda inputs, cfg=None: gspo_loss(inputs, **_kwargs(cfg, lambda c: {})))
register_loss(
    "prime_masked_is",
    lambda inputs, cfg=None: prime_masked_is_loss(inputs, **_kwargs(cfg, lambda c: {})),
)


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
