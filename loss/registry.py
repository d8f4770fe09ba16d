"""Losses by name, the dotted-path plugin hook, and the slime custom-loss adapter.

Owns: `register_loss`, `get_loss`, `get_loss_spec`, `available_losses`, `resolve_loss_spec`
(a registry name or a dotted path such as `--custom-loss-function-path my_pkg.losses.my_loss`),
`resolve_loss` and the built-in losses' specs; re-exports the slime custom-loss adapter
(`loss.slime_adapter`) so that `--custom-loss-function-path loss.registry.slime_compis_loss`
keeps working.

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
| sft | `SFTConfig` | π_θ only (NLL of the trained tokens; slime's `--loss-type sft_loss`) | loss_mask counts |

`register_loss(name, fn)` keeps working for a plain plugin `fn(inputs, cfg)`: it gets the
CompIS settings (`CompISConfig`) and reads everything CompIS reads, as before the seam existed;
pass `config_cls=` and `needs=` to declare less. A dotted path may name a `LossSpec` or a plain
function (treated the same way). For Python callers every built-in also accepts a
`CompISConfig` (the PPO knobs carry over; "decoupled_ppo" and "single_ratio" apply f3's method
and bounds to the combined ratio π_k/π_j^SGL) or a dict of its config's fields.

Must never import `slime_async` (nor slime).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

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
    single_ratio_denominators_read_logprobs,
    single_ratio_loss,
)
from loss.compis import compis_denominators, compis_denominators_read_logprobs, compis_loss
from loss.compis_metrics import compis_metrics
from loss.named import Registry, load_function, load_object
from loss.sft import SFTConfig, sft_loss
from loss.slime_adapter import (
    SlimeLossFn,
    compis_config_from_args,
    make_slime_loss,
    response_logprobs,
    slime_compis_loss,
)
from loss.spec import LossFn, LossNeeds, LossSpec
from loss.types import CompISConfig, LossInputs, LossOutputs, Method, PPOConfig

_LOSSES: Registry[LossSpec] = Registry(
    "loss",
    hint=" or give a dotted path to your own function (e.g. my_pkg.losses.my_loss)",
)

PLUGIN_NEEDS = LossNeeds(
    proximal_logprobs=True,
    behavior_logprobs=True,
    denominators=compis_denominators,
    denominators_read_logprobs=compis_denominators_read_logprobs,
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
    return _with_source_diagnostics(out, inputs, cfg)


def _single_ratio_loss(inputs: LossInputs, cfg: SingleRatioConfig | None = None) -> LossOutputs:
    """`single_ratio_loss` plus the same per-source diagnostics as plain PPO (its own weight
    stays `is/weight/*`), so a TIS/IcePop run logs the train-rollout gap and the combined
    ratio like every other loss."""
    cfg = cfg or SingleRatioConfig()
    return _with_source_diagnostics(single_ratio_loss(inputs, cfg), inputs, cfg)


def _with_source_diagnostics(out: LossOutputs, inputs: LossInputs, cfg: Any) -> LossOutputs:
    """`out` with CompIS's per-source diagnostics of `inputs` added (not its weight or loss
    terms), against CompIS's default bounds unless `cfg` is a `CompISConfig`."""
    if not cfg.diagnostics:
        return out
    diag = cfg if isinstance(cfg, CompISConfig) else CompISConfig(**cfg.ppo_knobs())
    extra = {
        k: float(v)
        for k, v in compis_metrics(inputs, diag).items()
        if not k.startswith(("is/weight/", "loss/"))
    }
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
    (
        "compis",
        lambda i, c: compis_loss(i, c or CompISConfig()),
        CompISConfig,
        PLUGIN_NEEDS,
        lambda c: c,
    ),
    ("ppo", _ppo_loss, PPOConfig, _PI_K_AND_SGL, lambda c: c),
    ("decoupled_ppo", decoupled_ppo_loss, DecoupledPPOConfig, _PI_K_AND_SGL, _decoupled_from),
    (
        "single_ratio",
        _single_ratio_loss,
        SingleRatioConfig,
        dataclasses.replace(
            _PI_K_AND_SGL,
            denominators=single_ratio_denominators,
            denominators_read_logprobs=single_ratio_denominators_read_logprobs,
        ),
        _single_from,
    ),
    ("m2po", m2po_loss, M2POConfig, _PI_K_AND_SGL, lambda c: M2POConfig(**c.ppo_knobs())),
    ("gspo", gspo_loss, GSPOConfig, LossNeeds(rollout_logprobs=False), lambda c: None),
    (
        "prime_masked_is",
        prime_masked_is_loss,
        PrimeMaskedISConfig,
        LossNeeds(proximal_logprobs=False),
        lambda c: None,
    ),
    (
        "sft",
        sft_loss,
        SFTConfig,
        LossNeeds(proximal_logprobs=False, rollout_logprobs=False),
        lambda c: SFTConfig(agg_mode=c.agg_mode, loss_scale_factor=c.loss_scale_factor),
    ),
]
for _args in _BUILTINS:
    _builtin(*_args)


# ---------------------------------------------------------------------------------- slime adapter
# `--custom-loss-function-path loss.registry.slime_compis_loss` is the documented path; the adapter
# itself lives in `loss.slime_adapter`.
__all__ = [
    "PLUGIN_NEEDS",
    "SlimeLossFn",
    "available_losses",
    "compis_config_from_args",
    "get_loss",
    "get_loss_spec",
    "make_slime_loss",
    "register_loss",
    "resolve_loss",
    "resolve_loss_spec",
    "response_logprobs",
    "slime_compis_loss",
]
