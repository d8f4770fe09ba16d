"""Many pipelines on one pool: the settings of a run that joins a pipeline scheduler
(`PipelineConfig`, its flags) and of the scheduler itself (`PipelineSchedulerConfig`). The
scheduler is `slime_async.orchestrator.pipeline_scheduler`, the run's side of it
`slime_async.orchestrator.pipeline_member`; the rules are docs/pipeline-scheduler.md. Their
configs live on the config side so that parsing a run imports nothing of the live run.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping

from clifields import add_flags, check_ranges, flag, from_args

DEMAND_WINDOW_S = 3600.0
"""`PipelineSchedulerConfig.demand_window_s` by default (the simulator's evidence, see there)."""
ROTATION_QUANTUM = 4.0
"""`PipelineSchedulerConfig.rotation_quantum` by default (see there)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    """How this run takes part in a pipeline scheduler (none: it owns its engines, as always)."""

    scheduler: str | None = flag(None, name="pipeline-scheduler", metavar="NAME")
    """Join the pipeline scheduler named NAME (a Ray actor in this Ray cluster, started by
    `start_scheduler`): its engines serve only while the scheduler grants their slots, and sleep
    otherwise (docs/pipeline-scheduler.md). Unset: the run owns its engines for its whole life."""
    name: str | None = flag(None, name="pipeline-name")
    """This pipeline's name at the scheduler, unique among the live ones (unset: the run
    directory's name)."""
    priority: float = flag(1.0, name="pipeline-priority", gt=0, lt=math.inf)
    """Weight of this pipeline's share of engine time (2 gets twice the time of 1 when both
    want engines)."""
    heartbeat_s: float = flag(0.5, cli=False)
    """Seconds between the run's reports (demand and heartbeat) to the scheduler."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if not 0 < self.heartbeat_s < math.inf:
            raise ValueError(
                f"heartbeat_s must be a finite number of seconds > 0, got {self.heartbeat_s}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSchedulerConfig:
    """The scheduler's own settings (it is started by whoever runs the pool, not by a run)."""

    slots: int = 1
    """Engine slots in the pool (devices); a pipeline's engine i sits on slot i mod slots."""
    heartbeat_timeout_s: float = 10.0
    """A pipeline silent this long is dropped: its grants go to the others at once."""
    min_hold_s: float = 2.0
    """A granted slot stays with its pipeline at least this long (a switch costs a sleep and a
    wake), unless a pipeline of higher priority needs it."""
    drain_timeout_s: float = 60.0
    """A slot handed over to a pipeline of equal or lower priority first drains: its engine
    takes no new request and the slot is released once its running requests finished, or
    after this many seconds (the rest are cut and sent whole to the pipeline's other engines).
    A pipeline of higher priority gets it at once (cut, no drain)."""
    fence_s: float = 30.0
    """A dropped (silent) pipeline's slots are granted to others only this long after the drop,
    or as soon as it joins again: the time its member has to put its engines to sleep on its
    own (it does once it had no answer for `heartbeat_timeout_s`), so that two engines never
    share a device."""
    min_pipelines: int = 1
    """Grant no slot before this many pipelines joined (a gang start: the pipelines of a pool
    begin sharing together); once reached, later leaves do not hold grants back."""
    spread: bool = False
    """Lend the slots nobody needs to pipelines whose requests could spread over more engines
    (fewer requests per engine decode faster); a lent slot is the first given up (idle ones
    first, busy ones drained) when another pipeline is short. Off: no pipeline holds more slots
    than its demand fills."""
    demand_window_s: float = DEMAND_WINDOW_S
    """Sustained demand (0: off, the instant rule alone; 3600 from the simulator: longer than
    a synchronous pipeline's step cycle, docs/results/2026-11-27-pipelines-sim.md). With it, each pipeline's slot need is also
    averaged over about this many seconds (an exponential average of its reports, started at
    its first report, moved by whole slots with half a slot of hysteresis), and the fair share
    of those sustained needs is its *claim*: the slots it keeps even while idle, and the only
    ones for which another pipeline's busy slot is drained or cut. Slots beyond the claims still
    go where the demand is now (free ones, and idle ones above their holder's claim), so nothing
    idles that a pipeline could use at no cut. A pipeline whose demand rises gets free and idle
    slots at its next report and busy ones as its average rises (within about this window); one
    that joins claims its first report's need at once; one that leaves frees its slots at once.
    With steady demand the grants settle on a split proportional to demand and stay there."""
    rotation_quantum: float = ROTATION_QUANTUM
    """The rotation quantum, in hand-overs: a granted slot serves its pipeline at least this
    many times the last hand-over's measured seconds (from the ask to give it up until its
    next holder serves there: sleep, wake, sync) before it is taken again for a pipeline of
    equal or lower priority, unless its holder needs no slot any more (no demand, nothing
    running). So at most about 1 / (1 + this) of a rotating slot's time goes to switching. 0:
    `min_hold_s` alone (no hand-over measured yet: the same)."""
    sleep_level: int = 2
    """How a pipeline's engine sleeps while its slot serves another: 1 frees the KV and prefix
    caches, 2 also the weights."""
    trainer_slots: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Partial overlap: pipeline name -> the pool slots its trainer trains on. Such a slot
    serves generation only between that pipeline's train steps (its own engine there first);
    before each step the engine on it is cut (its requests re-dispatched by its router), put
    to sleep and released, and the trainer waits for that (`before_training`). Empty: no slot
    is a trainer's, the trainers keep devices of their own."""
    overlap_others: bool = False
    """Grant a pipeline's trainer slot, between its steps, to other pipelines' engines too when
    its own does not need it (off: only its own pipeline's engine serves there)."""

    def __post_init__(self) -> None:
        if self.min_pipelines < 1:
            raise ValueError(f"min_pipelines must be >= 1, got {self.min_pipelines}")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        for name in (
            "heartbeat_timeout_s",
            "min_hold_s",
            "drain_timeout_s",
            "fence_s",
            "demand_window_s",
            "rotation_quantum",
        ):
            v = getattr(self, name)
            if not 0 <= v < math.inf:
                unit = "hand-overs" if name == "rotation_quantum" else "seconds"
                raise ValueError(f"{name} must be a finite number of {unit} >= 0, got {v}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level}")
        _check_trainer_slots(self.trainer_slots, self.slots)


def _check_trainer_slots(trainer_slots: Mapping[str, tuple[int, ...]], n: int) -> None:
    """Each trainer slot inside the pool and one pipeline's only."""
    seen: dict[int, str] = {}
    for name, slots in trainer_slots.items():
        if not slots:
            raise ValueError(f"trainer_slots[{name!r}] is empty: give its slots or drop it")
        for s in slots:
            if not (isinstance(s, int) and 0 <= s < n):
                raise ValueError(
                    f"trainer_slots[{name!r}]: slot {s!r} is outside the pool's 0..{n - 1}"
                )
            if s in seen:
                raise ValueError(
                    f"trainer_slots: slot {s} is the trainer slot of both {seen[s]!r} and "
                    f"{name!r}; one trainer per device"
                )
            seen[s] = name


def add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    """Add the pipeline-membership flags (the `PipelineConfig` fields that are flags)."""
    add_flags(parser, PipelineConfig, group="pipeline scheduler")


def pipeline_config_from_args(args: argparse.Namespace) -> PipelineConfig:
    return from_args(PipelineConfig, args)
