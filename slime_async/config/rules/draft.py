"""What a rule works on: `Draft` (the flags being derived, the environment, and the facts the
rules before produced) and `Rule` (a name, the function, the flags it may fill).

A rule reads the flags (`Draft.args`, through the `Flags` bookkeeping of
`slime_async.config.derive`), the environment and the typed facts earlier rules set on the
draft (`Draft.rollout`, `Draft.trainer`, ...), records what it derives with `Flags.fill` /
`Flags.note`, and refuses a contradiction with a ValueError naming the flag and the fix. A fact
no earlier rule has set is unset: reading it raises AttributeError, so a rule placed before the
rule it depends on fails at once instead of reading a default. Imports only config modules.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import TYPE_CHECKING, Any

from slime_async.config.derive import Flags
from slime_async.config.run_config import Environment

if TYPE_CHECKING:
    from data_worker.config import DataWorkerConfig
    from loss import LossSettings
    from router.config import RouterConfig
    from slime_async.config.engine_fleet import EngineFleetConfig
    from slime_async.config.run_config import RunConfig
    from slime_async.engine.config import EngineConfig
    from slime_async.rollout.config import RolloutConfig
    from slime_async.trainer.config import TrainerConfig

__all__ = ["Draft", "Placement", "Rule", "rule"]

_NOT_RECORDED = ("sglang_args", "config", "dry_run")
"""Parsed flags that are not the run's (`RunConfig.flags` leaves them out)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where the roles of this machine run (`placement` rule)."""

    colocate: bool
    trainer_cores: tuple[int, ...] = ()
    rollout_cores: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True, eq=False)
class Draft:
    """A run being derived: the flags, the environment, and each fact a rule has produced."""

    flags: Flags
    """The parsed flags and the values derived so far (`Flags.derived`, in the order derived)."""
    env: Environment
    """Facts from outside the flags (`read_environment`)."""
    given: dict[str, Any]
    """Every flag as parsed, before any rule ran (`RunConfig.flags`)."""
    embedded: bool = field(init=False, repr=False)
    """The embedded default run: no --hf-checkpoint, --prompt-data or --prompt-source."""
    rollout: RolloutConfig = field(init=False, repr=False)
    data_worker: DataWorkerConfig = field(init=False, repr=False)
    loss: LossSettings = field(init=False, repr=False)
    trainer: TrainerConfig = field(init=False, repr=False)
    engines: EngineFleetConfig = field(init=False, repr=False)
    placement: Placement = field(init=False, repr=False)
    router: RouterConfig = field(init=False, repr=False)
    api_key: str | None = field(init=False, repr=False)
    """The run's data-plane key (router and engines), if any."""
    admin_api_key: str | None = field(init=False, repr=False)
    """The run's admin key (router and engines), if any."""
    engine: EngineConfig = field(init=False, repr=False)
    config: RunConfig = field(init=False, repr=False)

    @classmethod
    def start(cls, args: argparse.Namespace, env: Environment) -> Draft:
        """A draft of the parsed `args` (left as given) before any rule ran."""
        given = {k: v for k, v in vars(args).items() if k not in _NOT_RECORDED}
        return cls(flags=Flags(args), env=env, given=given)

    @property
    def args(self) -> argparse.Namespace:
        """The flags, with the values derived so far filled in."""
        return self.flags.args

    def fork(self) -> Draft:
        """An independent copy (its own flags and record) to derive on."""
        other = Draft(flags=self.flags.copy(), env=self.env, given=dict(self.given))
        for f in dataclasses.fields(self):
            if f.init is False and hasattr(self, f.name):
                setattr(other, f.name, getattr(self, f.name))
        return other

    def adopt(self, other: Draft) -> None:
        """Take every flag, record and fact of `other` (a `fork` derived further)."""
        for f in dataclasses.fields(other):
            if hasattr(other, f.name):
                setattr(self, f.name, getattr(other, f.name))


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """One named step of validation: derives a fact (or refuses a contradiction) on a `Draft`."""

    name: str
    apply: Callable[[Draft], None]
    fills: tuple[str, ...] = ()
    """Flags it may set with `Flags.fill` (a re-run `Flags.forget`s them first)."""

    def __call__(self, draft: Draft) -> None:
        self.apply(draft)

    @property
    def doc(self) -> str:
        """What the rule derives and why (its function's docstring)."""
        return self.apply.__doc__ or ""

    def rerun(self, draft: Draft) -> None:
        """Apply again on a draft it ran on: what it filled is derived afresh."""
        for dest in self.fills:
            draft.flags.forget(dest)
        self.apply(draft)


def rule(name: str, *, fills: tuple[str, ...] = ()) -> Callable[[Callable[[Draft], None]], Rule]:
    """`@rule("steps", fills=("num_steps",))` over `def steps(d: Draft) -> None` makes it a
    `Rule` (still callable on a draft, so it is testable alone)."""

    def make(fn: Callable[[Draft], None]) -> Rule:
        return Rule(name, fn, fills)

    return make
