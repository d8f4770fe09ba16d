"""The pipeline scheduler's decisions, pure: no Ray, no clock of its own, no I/O.

Owns `PipelineState` (what the scheduler knows of one pipeline), `plan_slots` (the policy: who
each slot should serve next), `SchedulerCore` (the state machine around it: joins, reports,
heartbeats, hand-overs, drops; `now` is always given) and `generation_demand` (what a run
reports: the samples it still wants at its current version). The Ray actor
(`pipeline_scheduler.PipelineScheduler`) and the cluster-scale simulator
(`scripts/bench_sim_pipelines.py`, virtual time) both drive this one core, so what the
simulator measures is the policy the live scheduler runs. Rules: docs/pipeline-scheduler.md.
Must never import Ray, the controller or a run's roles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from slime_async.config.pipeline import PipelineSchedulerConfig


def generation_demand(metrics: Mapping[str, float], n_samples_per_prompt: int) -> int:
    """Samples a run still wants at its current version within its staleness bound: the
    groups its staleness budget still admits times the samples per group, plus the samples
    queued or in flight (from the data worker's `metrics()`).

    >>> m = {"data/admission_limit": 6, "data/live_groups": 4, "data/inflight": 3,
    ...      "data/queue_depth": 1}
    >>> generation_demand(m, 4)
    12
    """
    room = max(0.0, metrics["data/admission_limit"] - metrics["data/live_groups"])
    return int(room * n_samples_per_prompt + metrics["data/inflight"] + metrics["data/queue_depth"])


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
        self.undelivered: dict[int, str] = {}
        """Slots granted to a pipeline during another's report: its next report's `take`."""
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
                self.undelivered.pop(slot, None)
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
        now), `give_up` (slots to put to sleep, then `released`), `take` (slots granted
        to it since its last report, in its report or another's: wake, sync, serve)."""
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
        for slot, want in target.items():
            holder = self.owner[slot]
            if holder is None and want is not None:
                self.owner[slot], self.since[slot] = want, now
                self.undelivered[slot] = want
                self.events.append((now, want, f"granted slot {slot}"))
            elif holder is not None and want != holder and slot not in self.giving_up:
                self.giving_up[slot] = holder
                self.events.append((now, holder, f"asked to give up slot {slot}"))
        serve = [s for s, h in self.owner.items() if h == name and s not in self.giving_up]
        give_up = [s for s, h in self.giving_up.items() if h == name]
        mine = [s for s, h in self.undelivered.items() if h == name]
        for slot in mine:  # one given up before it was delivered sleeps already: no wake
            del self.undelivered[slot]
        take = [s for s in mine if s not in self.giving_up]
        return {"serve": sorted(serve), "give_up": sorted(give_up), "take": sorted(take)}

    def released(self, name: str, slot: int, *, now: float) -> None:
        """`name`'s engine on `slot` sleeps: the slot is free for the next grant."""
        if self.owner.get(slot) == name:
            self.owner[slot] = None
            self.giving_up.pop(slot, None)
            self.undelivered.pop(slot, None)
            self.events.append((now, name, f"released slot {slot}"))

    def state(self) -> dict[str, Any]:
        return {
            "owner": dict(self.owner),
            "giving_up": dict(self.giving_up),
            "pipelines": {n: dataclasses.asdict(p) for n, p in self.pipelines.items()},
            "events": list(self.events),
        }
