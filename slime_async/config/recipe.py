"""Config files in and out: recipes, a run's `config.json`, and `--dry-run`.

Owns `Invocation` (the flags about the invocation itself: `--config`, `--dry-run`),
`add_config_arg`, `apply_config_file` (a recipe or a run's config.json becomes the parser's
defaults) and `config_record` / `config_json` / `derived_lines` (what `<run-dir>/config.json` holds and `--dry-run`
prints: the resolved config, the flag values it was built from, and what the run derived).

A recipe is a mapping from flag names (as typed,
``rollout-batch-size``, or as attribute names, ``rollout_batch_size``) to values. Its values
become the parser's defaults, so a flag given on the command line wins over the recipe; a value
from the recipe counts as the user's (validation never replaces it). Each value goes through the
flag's own type and choices; an unknown key, a value a flag cannot take, or a non-mapping file
is refused with the file, the key and the fix. Relative paths in ``hf-checkpoint``, ``load``,
``save``, ``prompt-data`` and ``run-dir`` are kept as written (relative to the working
directory, like the same flag typed on the command line).

A run's `config.json` replays: its `flags` (every flag's value, None where the run derived it)
are read like a recipe, so `--config <run-dir>/config.json` rebuilds the same config, deriving
again what was derived before. The token is never recorded (`<set>` stands for it).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

from clifields import Switch, add_flags, flag

SECRET_KEYS = ("api_key", "admin_api_key", "auth_token", "router_auth_token")
"""Config keys whose value is a secret: recorded as `<set>` when set."""
_SECRET = "<set>"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Invocation:
    """Flags about the invocation itself, not the run."""

    config: str | None = flag(None, metavar="FILE")
    """A recipe (YAML mapping of flag names to values, e.g. recipes/*.yaml) or a run's
    config.json (replays the flags it records); flags given on the command line win over it,
    unknown keys are refused."""
    dry_run: bool = flag(False, aliases=("--print-config",))
    """Print the resolved config (as config.json records it) after the 'derived:' lines, and
    exit without starting anything."""


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """The invocation's flags (`Invocation`)."""
    add_flags(parser, Invocation)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag by its dest and by each long option name without the dashes."""
    by: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if not a.option_strings or a.dest in ("help", "config", "dry_run"):
            continue
        by[a.dest] = a
        for opt in a.option_strings:
            if opt.startswith("--"):
                by[opt[2:]] = a
    return by


def _convert(path: Path, key: str, action: argparse.Action, value: Any) -> Any:
    where = f"{path}: {key}"
    if value is None:
        return None
    if action.nargs == 0:  # a switch: the value of its dest
        if not isinstance(action, (Switch, argparse._StoreTrueAction)):
            raise ValueError(f"{where}: this switch cannot be set from a recipe; pass it as a flag")
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {value!r} must be true or false (it is a switch)")
        if isinstance(action, Switch) and "--" + key in action.off:  # no-x: true means x false
            return not value
        return value
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    items = value if isinstance(value, list) else [value]
    if not many and isinstance(value, list):
        raise ValueError(f"{where}: takes one value, got a list {value!r}")
    out = []
    for v in items:
        if isinstance(v, (dict, list)):
            raise ValueError(f"{where}: {v!r} is not a plain value")
        if action.type is not None:
            try:
                v = action.type(str(v) if not isinstance(v, str) else v)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"{where}: {v!r} is not a valid value ({e})") from None
        elif not isinstance(v, str):
            v = str(v)
        if action.choices is not None and v not in action.choices:
            raise ValueError(f"{where}: {v!r} is not one of {list(action.choices)}")
        out.append(v)
    return out if many else out[0]


def _read(p: Path) -> Any:
    """The file's mapping: a run's config.json gives its `flags`, a recipe itself."""
    import yaml

    if not p.is_file():
        raise ValueError(f"--config {p}: no such file")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ValueError(
            f"--config {p}: not valid {p.suffix[1:].upper() or 'YAML'} ({e})"
        ) from None
    if isinstance(data, dict) and p.suffix == ".json":
        if not isinstance(data.get("flags"), dict):
            raise ValueError(
                f"--config {p}: a JSON file must be a run's config.json (with its 'flags'); "
                "write a recipe as YAML"
            )
        flags = data["flags"]
        if any(flags.get(k) == _SECRET for k in SECRET_KEYS):
            raise ValueError(
                f"--config {p}: the run was given a token on the command line, which is never "
                "recorded; pass it through $SLIME_ASYNC_AUTH_TOKEN or --auth-token-file"
            )
        return {k: v for k, v in flags.items() if v is not None}
    return data


def apply_config_file(parser: argparse.ArgumentParser, path: str | Path) -> dict[str, Any]:
    """Read the recipe (or config.json) at `path` into `parser`'s defaults; returns the
    {dest: value} it set."""
    p = Path(path)
    data = _read(p)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {p}: must be a mapping of flag names to values")
    actions = _actions(parser)
    unknown = sorted(str(k) for k in data if str(k) not in actions)
    if unknown:
        raise ValueError(
            f"--config {p}: unknown key(s) {unknown}; keys are train_async.py flag names "
            "without the dashes (see train_async.py --help)"
        )
    values: dict[str, Any] = {}
    for key, value in data.items():
        action = actions[str(key)]
        if action.dest in values:
            raise ValueError(f"--config {p}: {key} sets --{action.dest} a second time")
        values[action.dest] = _convert(p, str(key), action, value)
    parser.set_defaults(**values)
    return values


def _plain(obj: Any) -> Any:
    """`obj` as JSON data: enums by value, paths and other objects as text, secrets hidden."""
    if isinstance(obj, dict):
        return {k: (_SECRET if k in SECRET_KEYS and v else _plain(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def config_record(cfg: Any) -> dict[str, Any]:
    """What `<run-dir>/config.json` holds: the resolved config (a `RunConfig`), with `flags` (the
    values it was built from; `--config` replays them) and `derived` ({flag: {value, why}})."""
    return _plain(dataclasses.asdict(cfg))


def config_json(cfg: Any) -> str:
    """`config_record` as the text written to config.json and printed by `--dry-run`."""
    return json.dumps(config_record(cfg), indent=2, allow_nan=True)


def derived_lines(cfg: Any) -> list[str]:
    """One 'derived: --FLAG VALUE (why)' line per value the run chose for an unset flag, then one
    'accepted: --FLAG VALUE (why)' line per flag of slime's scripts that sets nothing here."""
    lines = [f"derived: {flag} {d.value} ({d.why})" for flag, d in cfg.derived.items()]
    return lines + [f"accepted: {said} ({why})" for said, why in cfg.accepted.items()]
