"""The pipeline scheduler: several RL pipelines (runs) share one pool of engine slots.

Owns: `PipelineState`, `plan_slots` (the policy, a pure function), `SchedulerCore` (the state
machine: joins, reports, heartbeats, hand-overs) and `PipelineScheduler` (the core as a named
Ray actor), `start_scheduler` / `scheduler_handle`. The rules are docs/pipeline-scheduler.md:
each pipeline joins with its priority and the slots its engines sit on, and reports its
generation demand (samples it still wants at its current version within its staleness bound)
with every heartbeat; each slot serves one pipeline at a time; a slot moves only through a
hand-over (the holder is told to give it up, puts its engine there to sleep, confirms, and only
then is the slot granted to the next pipeline, which wakes its own engine there and gives it
its current version before it serves: selective sync); a pipeline that leaves, or stays silent
for `heartbeat_timeout_s`, loses its slots at once (its engines are no longer waited for). The
scheduler never talks to an engine itself: the pipelines act (`pipeline_member.py`).
Must never import the controller or a run's roles.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

from slime_async.config.pipeline import PipelineSchedulerConfig

SCHEDULER_NAMESPACE = "slime_async_pipelines"


@dataclasses.dataclass(slots=True)
class PipelineState:
    """What the scheduler knows of one pipeline."""

    name: str
    priority: float
    slots: tuple[int, ...]
    """Slots this pipeline has an engine on."""
    demand: int = 0
    """Samples it still wants at its current version (its last report)."""
    version: int = 0
    last_seen: float = 0.0
    served_s: float = 0.0
    """Slot-seconds granted so far (the fairness account, weighted by `priority`)."""


def plan_slots(
    pipelines: dict[str, PipelineState],
    owner: dict[int, str | None],
    since: dict[int, float],
    *,
    now: float,
    min_hold_s: float,
) -> dict[int, str | None]:
    """Who each slot should serve next (pure). A slot stays with its holder while the holder
    wants generation and has held it less than `min_hold_s`, or while no other pipeline on the
    slot wants generation; otherwise it goes to the pipeline on it that wants generation and
    has had the least slot time per unit of priority (ties: by name). A free slot nobody wants
    stays free.

    >>> a = PipelineState("a", 1.0, (0,), demand=4, served_s=10.0)
    >>> b = PipelineState("b", 1.0, (0,), demand=4)
    >>> plan_slots({"a": a, "b": b}, {0: "a"}, {0: 0.0}, now=5.0, min_hold_s=2.0)
    {0: 'b'}
    >>> plan_slots({"a": a, "b": b}, {0: "a"}, {0: 4.0}, now=5.0, min_hold_s=2.0)
    {0: 'a'}
    """
    target: dict[int, str | None] = {}
    for slot, holder in owner.items():
        on = [p for p in pipelines.values() if slot in p.slots]
        wanting = [p for p in on if p.demand > 0]
        held = pipelines.get(holder) if holder is not None else None
        if held is not None and (
            (held.demand > 0 and now - since.get(slot, now) < min_hold_s)
            or not [p for p in wanting if p.name != held.name]
        ):
            target[slot] = holder
            continue
        if not wanting:
            target[slot] = holder if held is not None else None
            continue
        best = min(wanting, key=lambda p: (p.served_s / p.priority, p.name))
        target[slot] = best.name
    return target


class SchedulerCore:
    """The scheduler's state and transitions (no Ray, no clock of its own: `now` is given)."""

    def __init__(self, cfg: PipelineSchedulerConfig) -> None:
        self.cfg = cfg
        self.pipelines: dict[str, PipelineState] = {}
        self.owner: dict[int, str | None] = dict.fromkeys(range(cfg.slots))
        self.since: dict[int, float] = {}
        self.giving_up: dict[int, str] = {}
        """Slots whose holder was told to give them up (they wait for its `released`)."""
        self.events: list[tuple[float, str, str]] = []
        """(time, pipeline, what): joins, grants, hand-overs, drops (for `state()`)."""
        self._accounted = 0.0
        self.gathered = cfg.min_pipelines <= 1
        """`min_pipelines` have joined (grants start)."""

    def join(self, name: str, *, priority: float, slots: list[int], now: float) -> None:
        if name in self.pipelines:
            raise ValueError(f"a pipeline named {name!r} is already live: give --pipeline-name")
        bad = [s for s in slots if not 0 <= s < self.cfg.slots]
        if bad or not slots:
            raise ValueError(f"slots {slots} outside the pool's 0..{self.cfg.slots - 1}")
        self.pipelines[name] = PipelineState(name, priority, tuple(slots), last_seen=now)
        self.events.append((now, name, "joined"))

    def leave(self, name: str, *, now: float, why: str = "left") -> None:
        """Drop `name`: its slots are free at once (a crashed engine is not waited for)."""
        if self.pipelines.pop(name, None) is None:
            return
        for slot, holder in self.owner.items():
            if holder == name:
                self.owner[slot] = None
                self.giving_up.pop(slot, None)
        self.events.append((now, name, why))

    def _account(self, now: float) -> None:
        dt, self._accounted = now - (self._accounted or now), now
        for holder in self.owner.values():
            if holder in self.pipelines:
                self.pipelines[holder].served_s += dt

    def _expire(self, now: float) -> None:
        for name, p in list(self.pipelines.items()):
            if now - p.last_seen > self.cfg.heartbeat_timeout_s:
                self.leave(name, now=now, why=f"dropped: silent for {now - p.last_seen:.1f}s")

    def report(self, name: str, *, demand: int, version: int, now: float) -> dict[str, Any]:
        """A heartbeat with the pipeline's demand; returns what it must do: `serve` (its slots
        now), `give_up` (slots to put to sleep, then `released`), `take` (slots just granted:
        wake, sync, serve)."""
        self._account(now)
        self._expire(now)
        p = self.pipelines.get(name)
        if p is None:
            raise KeyError(f"pipeline {name!r} is not joined (dropped after a silence?)")
        p.demand, p.version, p.last_seen = max(0, int(demand)), int(version), now
        self.gathered = self.gathered or len(self.pipelines) >= self.cfg.min_pipelines
        if not self.gathered:
            return {"serve": [], "give_up": [], "take": []}
        target = plan_slots(
            self.pipelines, self.owner, self.since, now=now, min_hold_s=self.cfg.min_hold_s
        )
        take = []
        for slot, want in target.items():
            holder = self.owner[slot]
            if holder is None and want is not None:
                self.owner[slot], self.since[slot] = want, now
                self.events.append((now, want, f"granted slot {slot}"))
                if want == name:
                    take.append(slot)
            elif holder is not None and want != holder and slot not in self.giving_up:
                self.giving_up[slot] = holder
                self.events.append((now, holder, f"asked to give up slot {slot}"))
        serve = [s for s, h in self.owner.items() if h == name and s not in self.giving_up]
        give_up = [s for s, h in self.giving_up.items() if h == name]
        return {"serve": sorted(serve), "give_up": sorted(give_up), "take": sorted(take)}

    def released(self, name: str, slot: int, *, now: float) -> None:
        """`name`'s engine on `slot` sleeps: the slot is free for the next grant."""
        if self.owner.get(slot) == name:
            self.owner[slot] = None
            self.giving_up.pop(slot, None)
            self.events.append((now, name, f"released slot {slot}"))

    def state(self) -> dict[str, Any]:
        return {
            "owner": dict(self.owner),
            "giving_up": dict(self.giving_up),
            "pipelines": {n: dataclasses.asdict(p) for n, p in self.pipelines.items()},
            "events": list(self.events),
        }


@ray.remote(num_cpus=0)
class PipelineScheduler:
    """`SchedulerCore` as a named Ray actor (wall clock: `time.monotonic`)."""

    def __init__(self, cfg: PipelineSchedulerConfig) -> None:
        self.core = SchedulerCore(cfg)

    def join(self, name: str, priority: float, slots: list[int]) -> None:
        self.core.join(name, priority=priority, slots=slots, now=time.monotonic())

    def leave(self, name: str) -> None:
        self.core.leave(name, now=time.monotonic())

    def report(self, name: str, demand: int, version: int) -> dict[str, Any]:
        return self.core.report(name, demand=demand, version=version, now=time.monotonic())

    def released(self, name: str, slot: int) -> None:
        self.core.released(name, slot, now=time.monotonic())

    def state(self) -> dict[str, Any]:
        self.core._expire(time.monotonic())
        return self.core.state()


def start_scheduler(name: str, cfg: PipelineSchedulerConfig) -> Any:
    """Start the scheduler `name` in the current Ray cluster (it lives until killed)."""
    return PipelineScheduler.options(
        name=name, namespace=SCHEDULER_NAMESPACE, lifetime="detached"
    ).remote(cfg)


def scheduler_handle(name: str) -> Any:
    """The running scheduler `name`; a clear error when there is none."""
    try:
        return ray.get_actor(name, namespace=SCHEDULER_NAMESPACE)
    except ValueError:
        raise RuntimeError(
            f"--pipeline-scheduler {name}: no pipeline scheduler of that name runs in this Ray "
            "cluster; start one first (slime_async.orchestrator.pipeline_scheduler."
            "start_scheduler) or drop the flag"
        ) from None
