"""The flags a run is deriving: `Flags` (the parsed namespace plus the values derived so far) and
`raise_all` (one ValueError for one or several refused flags).

Shared by `slime_async.config` (the cross-component rules) and `slime_async.config.run_paths` (the
rules about what a run starts from and writes). A flag the user set is never changed here: `fill`
only sets an unset one, and every derived value is recorded with its reason. Imports only
`slime_async.config.run_config`.
"""

from __future__ import annotations

import argparse
import enum
from typing import Any

from slime_async.config.run_config import Derived

__all__ = ["Flags", "raise_all"]


class Flags:
    """The parsed flags plus the values derived so far; never changes a flag the user set."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = argparse.Namespace(**vars(args))  # the caller's namespace stays as given
        self.derived: dict[str, Derived] = {}

    def unset(self, dest: str) -> bool:
        return getattr(self.args, dest) is None

    def fill(self, dest: str, value: Any, why: str) -> None:
        """Set an unset flag to `value` and record why."""
        assert self.unset(dest), dest
        setattr(self.args, dest, value)
        self.note(dest, value, why)

    def note(self, dest: str, value: Any, why: str) -> None:
        """Record the value a component resolved for an unset flag (as it would be typed)."""
        value = value.value if isinstance(value, enum.Enum) else value
        self.derived["--" + dest.replace("_", "-")] = Derived(value, why)


def raise_all(errors: list[str]) -> None:
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError("invalid flags:\n  - " + "\n  - ".join(errors))
