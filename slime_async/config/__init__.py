"""The config wing: everything that turns a command line into a checked `RunConfig`, before any
role starts.

Owns the parser and the entry point (`cli`), the cross-component rules, named and in their
order (`rules`), the run's config and environment (`run_config`), the derivation bookkeeping
(`derive`), what a run starts from and writes (`run_paths`), recipe files (`recipe`), slime's
flag table (`slime_flags`), the memory plan (`memory_plan`), the machine's facts (`hardware`) and
the engine supervisor's settings (`supervision`). Imports nothing of the live run (`slime_async.orchestrator`): the
architecture test holds that wall.
"""

from __future__ import annotations

from slime_async.config.cli import build_parser, parse_config, read_environment, validate
from slime_async.config.run_config import Environment, RunConfig

__all__ = [
    "Environment",
    "RunConfig",
    "build_parser",
    "parse_config",
    "read_environment",
    "validate",
]
