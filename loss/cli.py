"""The loss package's command line: which loss, its settings, and the advantage estimator.

Owns: `LossFlags` and `LossConfigFlags` (the flags, one dataclass field each: its docstring is
the help), `add_loss_args(parser)` (adds them and slime's, `loss.slime_cli.SlimeLossFlags`, as
one group) and `loss_settings_from_args(args) -> LossSettings` (the selected loss, its config
object, the advantage estimator). Must never import `slime_async`.

How a loss gets its settings: `--loss-config KEY=VALUE ...` and `--loss-config-file` give
fields of the selected loss's config class (converted to the field's type); each
`LossConfigFlags` field is a dedicated flag (slime's name where slime has one) of the config
field of the same name, for every loss whose config has it; slime's flags set the fields
`slime_loss_settings` says. A flag left unset (None) leaves the config class's default.

Rules (never silent): a setting is given once. A key in both `--loss-config` and the file, or
in either and through its dedicated flag, or twice in `--loss-config`, is refused; so is a
dedicated flag or key the selected loss's config does not have (the error lists the valid
keys). Derived values: `--eps-clip-high` defaults to `--eps-clip` when only the flag is given;
`loss_scale_factor` defaults to `default_loss_scale_factor` (the run's max response length)
when the config has that field and nothing set it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import types
import typing
from pathlib import Path
from typing import Any

from clifields import add_flags, dest_of, flag, flag_name, from_args
from loss.advantages import DEFAULT_ADVANTAGE_ESTIMATOR
from loss.registry import resolve_loss_spec
from loss.slime_cli import (
    add_slime_loss_args,
    advantage_estimator_from_args,
    check_loss_type,
    loss_type_name,
    regularizers_from_args,
    slime_loss_settings,
)
from loss.spec import LossSelection, LossSpec
from loss.types import AggMode, CompISConfig, Denom, Method


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossSettings:
    """What the loss flags select: the loss and its settings, and the advantage estimator."""

    loss: LossSelection
    """The loss (name or dotted path) and its config object (an instance of its config class)."""
    advantage_estimator: str
    """Registered advantage estimator (`loss.available_advantages()`)."""
    derived: tuple[tuple[str, Any, str], ...] = ()
    """(flag, value, why) of each setting the flags did not give but were derived; the caller
    says so once at start-up and records it (the values are also in `loss.config`)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossFlags:
    """Which loss, where its settings come from, and the advantage estimator."""

    loss: str | None = None
    """Loss by registry name (compis = default; ppo = no behaviour weight; decoupled_ppo,
    single_ratio, m2po, gspo, prime_masked_is; sft = supervised NLL) or a dotted path to a LossSpec or plugin
    fn(inputs, cfg) -> LossOutputs"""
    custom_loss_function_path: str | None = None
    """slime's name for --loss PATH (give one of the two)"""
    loss_config: tuple[str, ...] = flag((), extend=True, metavar="KEY=VALUE")
    """Settings of the selected loss: fields of its config class (repeatable; e.g. --loss-config
    tau=0.02 cap=5)"""
    loss_config_file: str | None = flag(None, metavar="PATH")
    """JSON or YAML mapping of the selected loss's settings"""
    advantage_estimator: str = DEFAULT_ADVANTAGE_ESTIMATOR
    """Advantage estimator: one of loss.available_advantages() (loss.register_advantage adds
    one); slime's gspo, cispo and ppo are refused with the equivalent"""


_COMPIS = CompISConfig()


def _config_default(field: str) -> str:
    """Help text of a dedicated flag left unset: the selected loss's own default (CompIS's
    shown, read from `CompISConfig`)."""
    value = getattr(_COMPIS, field)
    return f"the selected loss's config; compis: {'off' if value is None else value}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossConfigFlags:
    """Dedicated flags of loss settings: each sets the selected loss's config field of the same
    name (refused for a loss whose config lacks it). Unset (None): the config's default."""

    staleness_method: Method | None = flag(
        None, name="staleness-correction-method", derived=_config_default("staleness_method")
    )
    """Correction of the staleness (r3 = pi_k / pi_j^Meg) ratio"""
    staleness_low: float | None = flag(
        None, name="staleness-correction-low", derived=_config_default("staleness_low")
    )
    """Lower bound l of the staleness correction, clip/icepop"""
    staleness_high: float | None = flag(
        None, name="staleness-correction-high", derived=_config_default("staleness_high")
    )
    """Upper bound u of the staleness correction"""
    engine_method: Method | None = flag(
        None, name="engine-correction-method", derived=_config_default("engine_method")
    )
    """Correction of the engine mismatch (r2 = pi_j^Meg / pi_j^SGL) ratio"""
    engine_low: float | None = flag(
        None, name="engine-correction-low", derived=_config_default("engine_low")
    )
    """Lower bound l of the engine correction, clip/icepop"""
    engine_high: float | None = flag(
        None, name="engine-correction-high", derived=_config_default("engine_high")
    )
    """Upper bound u of the engine correction"""
    eps_clip: float | None = flag(None, derived=_config_default("eps_clip"))
    """PPO clip epsilon, low side"""
    eps_clip_high: float | None = flag(
        None, derived="--eps-clip when only it is given, else " + _config_default("eps_clip_high")
    )
    """PPO clip epsilon, high side; DAPO clip-higher uses 0.28"""
    dual_clip_c: float | None = flag(
        None, name="eps-clip-c", derived=_config_default("dual_clip_c")
    )
    """Dual-clip constant c > 1"""
    agg_mode: AggMode | None = flag(None, name="loss-agg-mode", derived=_config_default("agg_mode"))
    """Loss aggregation"""
    loss_scale_factor: float | None = flag(
        None, derived="the max response length, for a loss whose config has it"
    )
    """Constant H of seq-mean-token-sum-norm"""
    denom: Denom | None = flag(None, derived=_config_default("denom"))
    """Masked tokens keep or leave the loss denominator"""
    diagnostics: bool | None = flag(
        None, name="loss-diagnostics", derived=_config_default("diagnostics")
    )
    """Compute the loss's diagnostics (is/*, policy/*); --no-loss-diagnostics skips them
    (slightly faster)"""


def _given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """{field: value as parsed} of each flag of `cls` that is set (not None) in `args`."""
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, dest_of(cls, f.name), None)
        if value is not None:
            out[f.name] = value
    return out


def add_loss_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the loss flag group: `LossFlags`, `LossConfigFlags` and slime's `SlimeLossFlags`.
    Flags that can conflict default to None (unset: the loss's config class decides)."""
    g = parser.add_argument_group("loss")
    add_flags(g, LossFlags)
    add_flags(g, LossConfigFlags)
    add_slime_loss_args(g)
    return parser


# ------------------------------------------------------------------------------ conversion


def _options(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _coerce(tp: Any, value: Any) -> Any:
    """`value` (a string from the command line, or a JSON/YAML value) as type `tp`; raises
    ValueError naming the expected type."""
    opts = _options(tp)
    text = isinstance(value, str)
    if type(None) in opts and (value is None or (text and value.lower() in ("none", "null"))):
        return None
    for opt in opts:
        if isinstance(opt, type) and issubclass(opt, enum.Enum):
            try:
                return opt(value)
            except ValueError:
                if str in opts:
                    continue
                choices = ", ".join(str(m.value) for m in opt)
                raise ValueError(f"expected one of {choices}") from None
        if opt is bool:
            if isinstance(value, bool):
                return value
            if text and value.lower() in _TRUE + _FALSE:
                return value.lower() in _TRUE
            raise ValueError("expected true or false")
        if opt is int and not isinstance(value, bool):
            if isinstance(value, int):
                return value
            if text:
                try:
                    return int(value)
                except ValueError:
                    pass
            raise ValueError("expected an integer")
        if opt is float and not isinstance(value, bool):
            if isinstance(value, int | float):
                return float(value)
            if text:
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ValueError("expected a number")
        if opt is str:
            if text:
                return value
            raise ValueError("expected a string")
    return value  # a type the command line cannot spell: the config validates it


def _fields(cls: type) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # unresolvable annotations: values pass through unconverted
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--loss-config-file {path} does not exist")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    elif p.suffix == ".json":
        data = json.loads(text)
    else:
        raise ValueError(f"--loss-config-file {path}: use a .json, .yaml or .yml file")
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"--loss-config-file {path} must hold a mapping of setting names")
    return data


def _pairs(items: tuple[str, ...]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--loss-config expects KEY=VALUE, got {item!r}")
        out.append((key.strip(), value))
    return out


# ------------------------------------------------------------------------------- settings


def _loss_name(args: argparse.Namespace) -> str:
    flags = from_args(LossFlags, args)
    name, path = flags.loss, flags.custom_loss_function_path
    if name is not None and path is not None:
        raise ValueError(
            f"--loss {name} and --custom-loss-function-path {path} both select the loss; "
            "give one of them"
        )
    return loss_type_name(args, path or name) or LossSelection().name


def loss_config_from_args(
    spec: LossSpec, args: argparse.Namespace, *, default_loss_scale_factor: float | None = None
) -> tuple[Any, tuple[tuple[str, Any, str], ...]]:
    """(`spec`'s config object from the flags, (flag, value, why) of each derived setting);
    ValueError on conflicts, unknown keys or bad values (the message names the flag and the
    valid keys)."""
    cls = spec.config_cls
    given: dict[str, tuple[str, Any]] = {}  # field -> (where it was given, raw value)
    errors: list[str] = []
    fields = _fields(cls) if cls is not None else {}
    valid = ", ".join(fields) or "none: it takes no settings"
    where_cls = f"--loss {spec.name} ({cls.__name__ if cls else 'no config class'})"

    def give(key: str, where: str, value: Any) -> None:
        if key not in fields:
            errors.append(f"{where}: {where_cls} has no setting {key!r}; valid keys: {valid}")
        elif key in given:
            errors.append(f"{key!r} is given twice ({given[key][0]} and {where}); give it once")
        else:
            given[key] = (where, value)

    for key, value in _given(LossConfigFlags, args).items():
        where = flag_name(LossConfigFlags, key)
        give(key, where if value is not False else "--no-" + where[2:], value)
    for key, where, value in slime_loss_settings(args):
        give(key, where, value)
    flags = from_args(LossFlags, args)
    if flags.loss_config_file is not None:
        for key, value in _read_file(flags.loss_config_file).items():
            give(key, f"--loss-config-file {flags.loss_config_file}", value)
    for key, value in _pairs(flags.loss_config):
        give(key, f"--loss-config {key}={value}", value)
    derived: list[tuple[str, Any, str]] = []
    eps_clip = flag_name(LossConfigFlags, "eps_clip")
    if "eps_clip" in given and "eps_clip_high" not in given and given["eps_clip"][0] == eps_clip:
        given["eps_clip_high"] = (eps_clip, given["eps_clip"][1])
        high = flag_name(LossConfigFlags, "eps_clip_high")
        derived.append((high, given["eps_clip"][1], f"follows {eps_clip}"))
    lsf = default_loss_scale_factor
    if "loss_scale_factor" in fields and "loss_scale_factor" not in given and lsf is not None:
        given["loss_scale_factor"] = ("default", lsf)
        derived.append(
            (flag_name(LossConfigFlags, "loss_scale_factor"), lsf, "the max response length")
        )
    values: dict[str, Any] = {}
    for key, (where, raw) in given.items():
        try:
            values[key] = _coerce(fields[key], raw)
        except ValueError as e:
            errors.append(f"{where}: {where_cls}.{key} {e}, got {raw!r}")
    if errors:
        raise ValueError("; ".join(errors))
    if cls is None:
        return None, ()
    try:
        return cls(**values), tuple(derived)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where_cls}: {e}") from None


def loss_settings_from_args(
    args: argparse.Namespace, *, default_loss_scale_factor: float | None = None
) -> LossSettings:
    """The selected loss (resolved, so a bad name or path fails here), its config object built
    from the flags, and the advantage estimator. Raises ValueError with the fix."""
    spec = resolve_loss_spec(_loss_name(args))
    check_loss_type(args, spec.fn)
    cfg, derived = loss_config_from_args(
        spec, args, default_loss_scale_factor=default_loss_scale_factor
    )
    return LossSettings(
        loss=LossSelection(
            name=_loss_name(args), config=cfg, regularizers=regularizers_from_args(args)
        ),
        advantage_estimator=advantage_estimator_from_args(args),
        derived=derived,
    )
