"""One dataclass field, one command-line flag: argparse generated from frozen config dataclasses.

Owns `flag` (a dataclass field that carries its flag's spelling, choices and range), `add_flags`
(one argparse group from a config class), `from_args` (the config object back from the parsed
namespace), `check_ranges` (the ranges declared beside the fields, checked in `__post_init__`),
`field_docs` (the attribute docstrings, which are the flags' help), `flag_of` (which field an
argparse action was generated from) and `StrEnum` (`enum.StrEnum` on Python 3.10 too: the string
enums flags choose from). Imports only the standard library, so the leaf packages
(`loss`, `data_worker`, `router`) use it as well as `slime_async`.

A config field needs nothing more than its annotation, default and docstring to be a flag:

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class SchedConfig:
        max_staleness: int = flag(2, ge=0)
        \"\"\"S: 0 synchronous, 1 one-step off-policy, >1 fully async.\"\"\"
        fifo_window: float | None = flag(None, derived="2 x groups per step")
        \"\"\"W: completed groups consumable within [head, head + W).\"\"\"

gives `--max-staleness` (int, default 2, help = the docstring) and `--fifo-window` (float,
default None on the command line: the run derives it when unset). How a type is spelled:

* `bool`: `--name` / `--no-name` (plus any `off=` spellings, e.g. slime's `--disable-...`);
* `int`, `float`, `str`, `X | None`: one value of that type (`float` takes `inf`);
* `Literal[...]` and `enum.Enum` subclasses: one of the values (`choices`);
* `tuple[T, ...]`: one or more values (`nargs="+"`), or `parse=` for a comma-separated string.

Why not a library (tyro, simple-parsing, pydantic-settings): the run's flags keep slime's flat
names across components (`--rollout-temperature`, `--lr-warmup-iters`), a run derives some
defaults after parsing (their command-line default is None), recipes set parser defaults, and
`--sglang-*` flags pass through; each library would need the same adapters this module is.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import itertools
import math
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "FlagSpec",
    "HelpFormatter",
    "StrEnum",
    "Switch",
    "add_flags",
    "check_ranges",
    "dest_of",
    "field_docs",
    "flag",
    "flag_name",
    "flag_of",
    "flag_specs",
    "from_args",
    "range_errors",
]

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10

    class StrEnum(str, enum.Enum):
        """`enum.StrEnum` of Python 3.11+: members are strings and print as their value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return format(str(self.value), spec)

        @staticmethod
        def _generate_next_value_(name: str, *_: object) -> str:
            return name.lower()


_KEY = "clifields"
_MISSING: Any = dataclasses.MISSING


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FlagSpec:
    """How one config field is spelled on the command line (the field's `metadata`)."""

    name: str | None = None
    """Flag name without dashes and without the group prefix (None: the field name, dashed)."""
    aliases: tuple[str, ...] = ()
    """Other full spellings (`--model-path`), never prefixed."""
    off: tuple[str, ...] = ()
    """bool only: extra spellings that set False (slime's `--disable-...`), besides `--no-NAME`."""
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None
    """Allowed values (default: from a `Literal` or `Enum` annotation); a callable is read when
    the parser is built (a registry's names)."""
    derived: str | None = None
    """When unset the run derives the value: the flag's default is None and the help says this."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    """Range of the value (None bounds are open); `check_ranges` enforces them."""
    hint: str | None = None
    """Said after a range error ("0 = off")."""
    parse: Callable[[str], Any] | None = None
    """Converts one command-line string (default: from the annotation)."""
    nargs: str | int | None = None
    """argparse nargs (default: "+" for a tuple, one value otherwise)."""
    extend: bool = False
    """A tuple flag that may be repeated, its values accumulating (`--x a b --x c`: a, b, c);
    otherwise the last occurrence wins."""
    const: Any = _UNSET
    """With nargs="?": the value of the bare flag (slime's `--partial-rollout` switch)."""
    metavar: str | None = None
    """Placeholder in `--help`."""
    cli: bool = True
    """False: a field the program fills (never a flag)."""
    cli_default: Any = _UNSET
    """The command-line default when it must differ from the field's (rare: a flag whose unset
    state means "the component's own default" without being derived)."""


def flag(
    default: Any = _MISSING, *, default_factory: Any = _MISSING, repr: bool = True, **spec: Any
) -> Any:
    """A dataclass field with its flag's spec (`FlagSpec`'s fields as keywords); `repr=False`
    keeps a secret out of the config's repr."""
    meta = {_KEY: FlagSpec(**spec)}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta, repr=repr)
    return dataclasses.field(default=default, metadata=meta, repr=repr)


def flag_specs(cls: type) -> dict[str, FlagSpec]:
    """{field name: spec} of every init field of `cls` (a plain field gets `FlagSpec()`)."""
    return {f.name: f.metadata.get(_KEY, FlagSpec()) for f in dataclasses.fields(cls) if f.init}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its attribute docstring, whitespace folded} read from the class source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    stmts = body.body
    for stmt, nxt in itertools.pairwise(stmts):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_name(cls: type, field: str, *, prefix: str | None = None) -> str:
    """`--PREFIXNAME` of `cls.field` (prefix: the class's `FLAG_PREFIX`, default none)."""
    spec = flag_specs(cls)[field]
    prefix = getattr(cls, "FLAG_PREFIX", "") if prefix is None else prefix
    return "--" + prefix + (spec.name or field.replace("_", "-"))


def dest_of(cls: type, field: str, *, prefix: str | None = None) -> str:
    """The argparse dest of `cls.field`'s flag (its name, underscored)."""
    return flag_name(cls, field, prefix=prefix)[2:].replace("-", "_")


# ------------------------------------------------------------------------------- types


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _is_enum(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, enum.Enum)


class Switch(argparse.Action):
    """A bool flag: its names set True, `--no-NAME` and the `off` spellings set False."""

    def __init__(
        self, option_strings: list[str], dest: str, off: Sequence[str] = (), **kwargs: Any
    ) -> None:
        self.off = {s for s in option_strings if s.startswith("--no-")} | set(off)
        super().__init__(option_strings + list(off), dest, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: str | None = None) -> None:
        setattr(namespace, self.dest, option not in self.off)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _kwargs(cls: type, name: str, spec: FlagSpec, tp: Any, default: Any) -> dict[str, Any]:
    """argparse keyword arguments of field `name` of annotation `tp`."""
    inner, _ = _unwrap_optional(tp)
    kw: dict[str, Any] = {"default": default}
    choices = spec.choices() if callable(spec.choices) else spec.choices
    if inner is bool:
        return {**kw, "action": Switch, "off": spec.off}
    origin = typing.get_origin(inner)
    if origin is tuple and spec.parse is None:
        item = typing.get_args(inner)[0]
        kw["nargs"] = spec.nargs or "+"
        inner = item
    elif spec.nargs is not None:
        kw["nargs"] = spec.nargs
    if spec.const is not _UNSET:
        kw["const"] = spec.const
    if spec.extend:
        kw["action"] = "extend"
    if typing.get_origin(inner) is typing.Literal:
        choices = choices or typing.get_args(inner)
        inner = type(typing.get_args(inner)[0])
    elif _is_enum(inner):
        choices = choices or [m.value for m in inner]
        inner = str
    if spec.parse is not None:
        kw["type"] = spec.parse
    elif inner in (int, float):
        kw["type"] = inner
    elif inner is not str:
        raise TypeError(
            f"{cls.__name__}.{name}: a {inner!r} field cannot be a flag; give it parse= or cli=False"
        )
    if choices is not None:
        kw["choices"] = list(choices)
    if spec.metavar:
        kw["metavar"] = spec.metavar
    return kw


def _help(doc: str, spec: FlagSpec) -> str:
    text = doc or "(undocumented)"
    if spec.derived:
        text += f" (default: derived: {spec.derived})"
    return text.replace("%", "%%")


def _cli_default(f: dataclasses.Field, spec: FlagSpec) -> Any:
    """The flag's default as argparse holds it: None for a derived field, else the field's (or
    `cli_default`); an enum by its value, an empty tuple as None."""
    if spec.derived:
        return None
    if spec.cli_default is not _UNSET:
        default = spec.cli_default
    elif f.default is not _MISSING:
        default = f.default
    else:
        default = f.default_factory()  # type: ignore[misc]
    if isinstance(default, enum.Enum):
        return default.value
    if isinstance(default, tuple):
        return list(default) or None
    return default


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    group: str | None = None,
    prefix: str | None = None,
    exclude: Sequence[str] = (),
    only: Sequence[str] | None = None,
    derived: Mapping[str, str] | None = None,
) -> argparse._ArgumentGroup | argparse.ArgumentParser:
    """Add one flag per field of `cls` (into a new group `group`, else into `parser` as given);
    `only`/`exclude` pick fields (a program that sets some fields itself); `derived` names
    fields this program derives although the class gives them a default ({field: how}: their
    flag defaults to None and its help says `derived: how`, as `FlagSpec.derived` does).

    Defaults come from the class (None for a derived field); help is the field's docstring.
    Every action records its field (`flag_of`)."""
    target = parser.add_argument_group(group) if group else parser
    hints, docs = _hints(cls), field_docs(cls)
    pre = getattr(cls, "FLAG_PREFIX", "") if prefix is None else prefix
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY, FlagSpec())
        if not f.init or not spec.cli or f.name in exclude:
            continue
        if only is not None and f.name not in only:
            continue
        if derived and f.name in derived:
            spec = dataclasses.replace(spec, derived=derived[f.name])
        default = _cli_default(f, spec)
        names = [flag_name(cls, f.name, prefix=pre), *spec.aliases]
        kw = _kwargs(cls, f.name, spec, hints[f.name], default)
        if kw.get("action") is Switch:
            names.insert(1, "--no-" + names[0][2:])
        action = target.add_argument(
            *names,
            dest=dest_of(cls, f.name, prefix=pre),
            help=_help(docs.get(f.name, ""), spec),
            **kw,
        )
        action.clifield = (cls, f.name)  # type: ignore[attr-defined]
    return target


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless its help states one, it has none, or it takes no value."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.nargs == 0 or "default" in text:
            return text
        return super()._get_help_string(action)


def flag_of(action: argparse.Action) -> tuple[type, str] | None:
    """(config class, field) an action was generated from, or None for a hand-written one."""
    return getattr(action, "clifield", None)


def _value(tp: Any, value: Any) -> Any:
    inner, _ = _unwrap_optional(tp)
    if value is None:
        return None
    if typing.get_origin(inner) is tuple and isinstance(value, list):
        return tuple(value)
    if _is_enum(inner) and not isinstance(value, inner):
        return inner(value)
    return value


def from_args(
    cls: type, args: argparse.Namespace, *, prefix: str | None = None, **given: Any
) -> Any:
    """`cls(...)` from the flags `add_flags` added, plus `given` (fields the caller fills).

    A flag still None (unset, and not derived by the caller) leaves the class default; so does a
    flag absent from `args`. A field whose command-line value may be None on purpose maps it with
    its `parse` (e.g. 'none' -> None) and keeps a non-None command-line default."""
    hints = _hints(cls)
    pre = getattr(cls, "FLAG_PREFIX", "") if prefix is None else prefix
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY, FlagSpec())
        if not f.init or f.name in given or not spec.cli:
            continue
        dest = dest_of(cls, f.name, prefix=pre)
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if value is None and _cli_default(f, spec) is None:
            continue  # unset: the class default
        kwargs[f.name] = _value(hints[f.name], value)
    return cls(**kwargs, **given)


def _range_error(cls: type, name: str, spec: FlagSpec, v: Any, *, prefix: str | None) -> str:
    """The sentence for `v` outside `cls.name`'s declared range, or "" when it is inside."""
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return ""
    bad = (
        (spec.ge is not None and not v >= spec.ge and f">= {spec.ge:g}")
        or (spec.gt is not None and not v > spec.gt and f"> {spec.gt:g}")
        or (spec.le is not None and not v <= spec.le and f"<= {spec.le:g}")
        or (spec.lt is not None and not v < spec.lt and f"< {spec.lt:g}")
        or (isinstance(v, float) and math.isnan(v) and "a number")
    )
    if not bad:
        return ""
    hint = f" ({spec.hint})" if spec.hint else ""
    return f"{flag_name(cls, name, prefix=prefix)} must be {bad}{hint}, got {v}"


def check_ranges(cfg: Any) -> None:
    """Raise ValueError naming the flag for the first field outside its declared range."""
    cls = type(cfg)
    for name, spec in flag_specs(cls).items():
        if error := _range_error(cls, name, spec, getattr(cfg, name), prefix=None):
            raise ValueError(error)


def range_errors(cls: type, args: argparse.Namespace, *, prefix: str | None = None) -> list[str]:
    """Every flag of `cls` in `args` outside its declared range (all at once, before the config
    object exists: a caller that derives from the flags checks them first)."""
    errors = []
    for name, spec in flag_specs(cls).items():
        dest = dest_of(cls, name, prefix=prefix)
        value = getattr(args, dest, None) if spec.cli else None
        if error := _range_error(cls, name, spec, value, prefix=prefix):
            errors.append(error)
    return errors
