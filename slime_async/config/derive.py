"""The flags a run is deriving: `Flags` (the parsed namespace plus the values derived so far) and
`raise_all` (one ValueError for one or several refused flags).

Shared by `slime_async.config.rules` (the named rules that derive a run) and
`slime_async.config.run_paths` (the rules about what a run starts from and writes). A flag the user set is never changed here: `fill`
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
        self.filled: set[str] = set()
        """The flags `fill` set (the user left them unset)."""
        self.accepted: dict[str, str] = {}
        """Flags of slime's scripts that set nothing here, as given -> why they are accepted."""

    def copy(self) -> Flags:
        """An independent copy: deriving on it leaves this one as it is."""
        other = Flags(self.args)
        other.derived, other.filled = dict(self.derived), set(self.filled)
        other.accepted = dict(self.accepted)
        return other

    def unset(self, dest: str) -> bool:
        return getattr(self.args, dest) is None

    def fill(self, dest: str, value: Any, why: str) -> None:
        """Set an unset flag to `value` and record why."""
        assert self.unset(dest), dest
        setattr(self.args, dest, value)
        self.filled.add(dest)
        self.note(dest, value, why)

    def forget(self, dest: str) -> None:
        """Undo a `fill`, so that a rule run again derives the flag again: the flag unset, its
        record kept in its place (the new record replaces it there). A flag the user set stays."""
        if dest in self.filled:
            setattr(self.args, dest, None)
            self.filled.discard(dest)

    def note(self, dest: str, value: Any, why: str) -> None:
        """Record the value a component resolved for an unset flag (as it would be typed)."""
        value = value.value if isinstance(value, enum.Enum) else value
        self.derived["--" + dest.replace("_", "-")] = Derived(value, why)


def raise_all(errors: list[str]) -> None:
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError("invalid flags:\n  - " + "\n  - ".join(errors))
