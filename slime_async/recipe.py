"""Recipe files: `train_async.py --config FILE.yaml` gives flag values from a YAML mapping.

Owns `add_config_arg` and `apply_config_file`. A recipe is a mapping from flag names (as typed,
``rollout-batch-size``, or as attribute names, ``rollout_batch_size``) to values. Its values
become the parser's defaults, so a flag given on the command line wins over the recipe; a value
from the recipe counts as the user's (validation never replaces it). Each value goes through the
flag's own type and choices; an unknown key, a value a flag cannot take, or a non-mapping file
is refused with the file, the key and the fix. Relative paths in ``hf-checkpoint``, ``load``,
``save``, ``prompt-data`` and ``run-dir`` are kept as written (relative to the working
directory, like the same flag typed on the command line).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help="Recipe: a YAML mapping of flag names to values (e.g. recipes/*.yaml); flags given "
        "on the command line win over it, unknown keys are refused.",
    )


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag by its dest and by each long option name without the dashes."""
    by: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if not a.option_strings or a.dest in ("help", "config"):
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
    if action.nargs == 0:  # store_true / BooleanOptionalAction: the value of its dest
        if not isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            raise ValueError(f"{where}: this switch cannot be set from a recipe; pass it as a flag")
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {value!r} must be true or false (it is a switch)")
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


def apply_config_file(parser: argparse.ArgumentParser, path: str | Path) -> dict[str, Any]:
    """Read the recipe at `path` into `parser`'s defaults; returns {dest: value} it set."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {p}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"--config {p}: not valid YAML ({e})") from None
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
