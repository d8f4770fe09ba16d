"""Command-line tools (model and checkpoint conversion).

Owns `run_tool`: the command line every checkpoint tool shares (its config dataclass's flags,
`--load` and `--out` required, a refusal printed as the usage error, `wrote PATH` on success).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clifields import HelpFormatter, add_flags, from_args


def run_tool(
    argv: list[str] | None,
    *,
    prog: str,
    description: str,
    config: type,
    action: Callable[[Any], Path],
    refusals: tuple[type[Exception], ...],
) -> int:
    """Parse `argv` into `config` (whose `load` and `out` fields are required), run
    `action(cfg)` and print what it wrote; an exception in `refusals` is the usage error (exit 2)."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    add_flags(p, config)
    cfg = from_args(config, p.parse_args(argv))
    missing = [f"--{n}" for n in ("load", "out") if getattr(cfg, n) is None]
    if missing:
        p.error(f"{' and '.join(missing)} required")
    try:
        out = action(cfg)
    except refusals as e:
        p.error(str(e))
    print(f"wrote {out}")
    return 0
