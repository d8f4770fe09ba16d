"""The loss package's command line: which loss, its settings, and the advantage estimator.

Owns: `add_loss_args(parser)` (the flags below) and `loss_settings_from_args(args) ->
LossSettings` (the selected loss, its config object, the advantage estimator). Must never
import `slime_async`.

Flags:
* `--loss NAME|PATH` or `--custom-loss-function-path PATH` (slime's name): a registered loss or
  a dotted path to a `LossSpec` / plugin function. Give one of them.
* `--loss-config KEY=VALUE ...` (repeatable) and `--loss-config-file settings.{json,yaml}`:
  fields of the selected loss's config class, converted to the field's type.
* The dedicated CompIS/PPO flags (`--eps-clip`, `--staleness-correction-method`, ...) set the
  config field of the same meaning, for every loss whose config has that field.
* `--advantage-estimator` (`loss.available_advantages()`; slime's names are refused with
  our equivalent) and slime's loss flags (`loss.slime_cli`: `--loss-type`, `--use-tis`,
  `--tis-clip(-low)`, `--calculate-per-token-loss`, `--disable-grpo-std-normalization`).

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

from loss.advantages import DEFAULT_ADVANTAGE_ESTIMATOR, available_advantages
from loss.registry import resolve_loss_spec
from loss.slime_cli import (
    add_slime_loss_args,
    advantage_estimator_from_args,
    check_loss_type,
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


@dataclasses.dataclass(frozen=True, slots=True)
class _Flag:
    flag: str
    """The dedicated flag (slime's name where slime has one)."""
    field: str
    """The config field it sets."""
    kwargs: dict[str, Any]
    """`add_argument` keyword arguments besides the default."""


def _dedicated() -> tuple[_Flag, ...]:
    d = CompISConfig()
    methods = [m.value for m in Method]
    out = []
    for src, ratio in (
        ("staleness", "staleness (r3 = pi_k / pi_j^Meg)"),
        ("engine", "engine mismatch (r2 = pi_j^Meg / pi_j^SGL)"),
    ):
        out += [
            _Flag(f"--{src}-correction-method", f"{src}_method", dict(choices=methods,
                  help=f"Correction of the {ratio} ratio (default: "
                  f"{getattr(d, f'{src}_method')})")),
            _Flag(f"--{src}-correction-low", f"{src}_low", dict(type=float,
                  help=f"Lower bound l of the {src} correction, clip/icepop (default: "
                  f"{getattr(d, f'{src}_low')})")),
            _Flag(f"--{src}-correction-high", f"{src}_high", dict(type=float,
                  help=f"Upper bound u of the {src} correction (default: "
                  f"{getattr(d, f'{src}_high')})")),
        ]  # fmt: skip
    return (
        *out,
        _Flag("--eps-clip", "eps_clip", dict(type=float,
              help=f"PPO clip epsilon, low side (default: {d.eps_clip})")),
        _Flag("--eps-clip-high", "eps_clip_high", dict(type=float,
              help="PPO clip epsilon, high side; DAPO clip-higher uses 0.28 (default: "
              "--eps-clip)")),
        _Flag("--eps-clip-c", "dual_clip_c", dict(type=float,
              help="Dual-clip constant c > 1 (default: off)")),
        _Flag("--loss-agg-mode", "agg_mode", dict(choices=[m.value for m in AggMode],
              help=f"Loss aggregation (default: {d.agg_mode})")),
        _Flag("--loss-scale-factor", "loss_scale_factor", dict(type=float,
              help="Constant H of seq-mean-token-sum-norm (default: max response length)")),
        _Flag("--denom", "denom", dict(choices=[m.value for m in Denom],
              help=f"Masked tokens keep or leave the loss denominator (default: {d.denom})")),
        _Flag("--no-loss-diagnostics", "diagnostics", dict(action="store_false",
              help="Skip the loss's diagnostics (is/*, policy/*; slightly faster)")),
    )  # fmt: skip


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_loss_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the loss flag group. Flags that can conflict have no argparse default, so an unset
    flag is absent from the namespace (defaults come from the loss's config class)."""
    g = parser.add_argument_group("loss")
    unset = argparse.SUPPRESS
    g.add_argument("--loss", default=unset,
                   help="Loss by registry name (compis = default; ppo = no behaviour weight; "
                   "decoupled_ppo, single_ratio, m2po, gspo, prime_masked_is) or a dotted path "
                   "to a LossSpec or plugin fn(inputs, cfg) -> LossOutputs")  # fmt: skip
    g.add_argument("--custom-loss-function-path", default=unset,
                   help="slime's name for --loss PATH (give one of the two)")  # fmt: skip
    g.add_argument("--loss-config", action="extend", nargs="+", default=unset,
                   metavar="KEY=VALUE",
                   help="Settings of the selected loss: fields of its config class "
                   "(repeatable; e.g. --loss-config tau=0.02 cap=5)")  # fmt: skip
    g.add_argument("--loss-config-file", default=unset, metavar="PATH",
                   help="JSON or YAML mapping of the selected loss's settings")  # fmt: skip
    for f in _dedicated():
        g.add_argument(f.flag, default=unset, **f.kwargs)
    g.add_argument("--advantage-estimator", default=DEFAULT_ADVANTAGE_ESTIMATOR,
                   help=f"Advantage estimator: {', '.join(available_advantages())} "
                   "(loss.register_advantage adds one)")  # fmt: skip
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


def _pairs(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--loss-config expects KEY=VALUE, got {item!r}")
        out.append((key.strip(), value))
    return out


# ------------------------------------------------------------------------------- settings


def _loss_name(args: argparse.Namespace) -> str:
    name, path = getattr(args, "loss", None), getattr(args, "custom_loss_function_path", None)
    if name is not None and path is not None:
        raise ValueError(
            f"--loss {name} and --custom-loss-function-path {path} both select the loss; "
            "give one of them"
        )
    return path or name or LossSelection().name


def loss_config_from_args(
    spec: LossSpec, args: argparse.Namespace, *, default_loss_scale_factor: float | None = None
) -> tuple[Any, tuple[tuple[str, Any, str], ...]]:
    """(`spec`'s config object from the flags, (flag, value, why) of each derived setting);
    ValueError on conflicts,
    unknown keys or bad values (the message names the flag and the valid keys)."""
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

    for f in _dedicated():
        if hasattr(args, _dest(f.flag)):
            give(f.field, f.flag, getattr(args, _dest(f.flag)))
    for key, where, value in slime_loss_settings(args):
        give(key, where, value)
    if getattr(args, "loss_config_file", None) is not None:
        for key, value in _read_file(args.loss_config_file).items():
            give(key, f"--loss-config-file {args.loss_config_file}", value)
    for key, value in _pairs(getattr(args, "loss_config", None) or []):
        give(key, f"--loss-config {key}={value}", value)
    derived: list[tuple[str, Any, str]] = []
    if (
        "eps_clip" in given
        and "eps_clip_high" not in given
        and given["eps_clip"][0] == "--eps-clip"
    ):
        given["eps_clip_high"] = ("--eps-clip", given["eps_clip"][1])
        derived.append(("--eps-clip-high", given["eps_clip"][1], "follows --eps-clip"))
    lsf = default_loss_scale_factor
    if "loss_scale_factor" in fields and "loss_scale_factor" not in given and lsf is not None:
        given["loss_scale_factor"] = ("default", lsf)
        derived.append(("--loss-scale-factor", lsf, "the max response length"))
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
