"""The engine supervisor's settings: `SupervisorConfig` and its flags (`--engine-restart-after`,
`--engine-hung-timeout`, `--engine-down-timeout`). The supervisor itself is `slime_async.orchestrator.supervisor`; its
config lives on the config side so that parsing a run imports nothing of the live run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from clifields import add_flags, check_ranges, flag, from_args


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SupervisorConfig:
    """When to restart engines and when to give up."""

    interval_s: float = flag(1.0, cli=False)
    """Seconds between checks."""
    restart_after_s: float = flag(10.0, name="engine-restart-after", gt=0, lt=math.inf)
    """Restart an engine the router has held unhealthy this many seconds (dead actors at
    once)."""
    hung_timeout_s: float = flag(30.0, name="engine-hung-timeout", gt=0, lt=math.inf)
    """Before restarting an engine that is still running, ask it for a 1-token generation
    (`/health_generate`) and wait this many seconds: one that answers is slow (a loaded node,
    a long prefill), not hung, and keeps serving; it is looked at again after another
    --engine-restart-after. slime's --rollout-health-check-timeout plays this part (30 s)."""
    all_down_timeout_s: float = flag(120.0, name="engine-down-timeout", gt=0, lt=math.inf)
    """With no healthy engine for this many seconds, stop the run with a checkpoint."""
    log_every_s: float = flag(10.0, cli=False)
    """How often to repeat the 'no healthy engine' line while waiting."""
    relocate_wait_s: float = flag(10.0, cli=False)
    """An engine whose node is lost: seconds to wait for Ray to re-place its bundle on a live
    node with room before the run goes on without that engine."""
    max_restarts: int = flag(20, cli=False)
    """Give up after this many restarts in one run (an engine that keeps dying is a bug)."""

    def __post_init__(self) -> None:
        check_ranges(self)
        for name in ("interval_s", "log_every_s", "relocate_wait_s"):  # no flags: named as fields
            if not 0 < (v := getattr(self, name)) < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {v}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")


def add_supervisor_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine-supervision flags: the `SupervisorConfig` fields that are flags."""
    add_flags(parser, SupervisorConfig, group="engine supervision")


def supervisor_config_from_args(args: argparse.Namespace) -> SupervisorConfig:
    """Build the config from `add_supervisor_args` flags."""
    return from_args(SupervisorConfig, args)
