"""The pipeline scheduler's state machine, pure: no Ray, no clock of its own (`now` is always
given), no I/O.

Owns `SchedulerCore`: joins, reports, heartbeats, hand-overs, drops and fences, the rotation
quantum's measured hand-over, the fairness account (`served_s`, kept past a pipeline's leave),
and the trainer hooks of partial overlap (a trainer slot serves generation only between its
pipeline's `before_training` and `after_training`). Which slot goes to whom at each decision is
`pipeline_policy.plan_slots`'s; this module applies its plan and keeps the state around it. The
Ray actor (`pipeline_scheduler.PipelineScheduler`) and the cluster-scale simulator
(`scripts/simulate_pipelines.py`, virtual time) both drive this one class. Rules:
docs/pipeline-scheduler.md. Must never import Ray, the controller or a run's roles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from slime_async.config.pipeline import PipelineSchedulerConfig
from slime_async.orchestrator.pipeline_claims import sustain
from slime_async.orchestrator.pipeline_policy import PipelineState, plan_slots, slot_need

__all__ = ["SchedulerCore"]


class SchedulerCore:
    """The scheduler's state and transitions (no Ray, no clock of its own: `now` is given)."""

    def __init__(self, cfg: PipelineSchedulerConfig) -> None:
        self.cfg = cfg
        self.pipelines: dict[str, PipelineState] = {}
        self.owner: dict[int, str | None] = dict.fromkeys(range(cfg.slots))
        self.since: dict[int, float] = {}
        self.giving_up: dict[int, str] = {}
        """Slots whose holder was told to give them up (they wait for its `released`)."""
        self.cutting: set[int] = set()
        """Of those, the ones to give up at once (a pipeline of higher priority wants them)."""
        self.undelivered: dict[int, str] = {}
        """Slots granted to a pipeline during another's report: its next report's `take`."""
        self.fenced: dict[int, tuple[str, float]] = {}
        """Slots of a dropped pipeline: (its name, until when nobody is granted them)."""
        self.events: list[tuple[float, str, str]] = []
        """(time, pipeline, what): joins, grants, hand-overs, drops (for `state()`)."""
        self.served_before: dict[str, float] = {}
        """Slot-seconds served by each pipeline's earlier memberships (kept when it leaves,
        so the fairness of the grants can be read after the pipelines are gone)."""
        self._accounted = 0.0
        self.gathered = cfg.min_pipelines <= 1
        """`min_pipelines` have joined (grants start)."""
        self.trainer_of = {s: n for n, slots in cfg.trainer_slots.items() for s in slots}
        """Partial overlap: each trainer slot and the pipeline whose trainer trains there."""
        self.asked: dict[int, float] = {}
        """Slots asked to be given up to another pipeline, since when (a hand-over begins)."""
        self.switching: dict[int, float] = {}
        """Released slots of a hand-over, since when it began, until their next holder serves
        there (reports running requests on it, or it among its routed engines)."""
        self.handover_s = 0.0
        """The last hand-over's seconds, ask to serving (0: none measured yet): times
        `rotation_quantum`, the least a granted slot serves before it is taken again."""
        self.training: dict[str, float] = {}
        """Pipelines whose trainer holds its slots (or waits for them), since when: between
        `before_training` and `after_training`; their trainer slots are granted to nobody."""

    def join(
        self, name: str, *, priority: float, slots: list[int], now: float, capacity: int = 1
    ) -> dict[str, float]:
        """Join (or join again after a drop: the member joins only once every engine of it
        sleeps, so its fenced slots are free at once). Returns the timings the member keeps
        and its trainer slots (partial overlap), and the level its engines sleep at."""
        if name in self.pipelines:
            raise ValueError(f"a pipeline named {name!r} is already live: give --pipeline-name")
        bad = [s for s in slots if not 0 <= s < self.cfg.slots]
        if bad or not slots:
            raise ValueError(f"slots {slots} outside the pool's 0..{self.cfg.slots - 1}")
        if capacity < 1:
            raise ValueError(f"capacity (requests per engine) must be >= 1, got {capacity}")
        mine = self.cfg.trainer_slots.get(name, ())
        if not set(mine) <= set(slots):
            raise ValueError(
                f"pipeline {name!r}: its trainer slots {sorted(mine)} must be among the slots its "
                f"engines sit on {sorted(slots)} (its own engine serves there between its "
                "steps): start an engine on each, or change the scheduler's trainer_slots"
            )
        for slot, (holder, _) in list(self.fenced.items()):
            if holder == name:
                del self.fenced[slot]
        self.pipelines[name] = PipelineState(
            name, priority, tuple(slots), capacity=int(capacity), last_seen=now
        )
        self.events.append((now, name, "joined"))
        return {
            "heartbeat_timeout_s": self.cfg.heartbeat_timeout_s,
            "drain_timeout_s": self.cfg.drain_timeout_s,
            "trainer_slots": list(mine),
            "sleep_level": self.cfg.sleep_level,
        }

    def leave(self, name: str, *, now: float, why: str = "left", fence: bool = False) -> None:
        """Drop `name`: its slots are free at once, or after `fence_s` when `fence` (a silent
        pipeline's engines may still run until its member puts them to sleep)."""
        self._account(now)
        left = self.pipelines.pop(name, None)
        if left is None:
            return
        self.served_before[name] = self.served_before.get(name, 0.0) + left.served_s
        if self.training.pop(name, None) is not None:  # its trainer may still hold its slots
            for slot in self.cfg.trainer_slots[name]:
                self.fenced[slot] = (name, now + self.cfg.fence_s)
        for slot, holder in self.owner.items():
            if holder == name:
                self.owner[slot] = None
                self.giving_up.pop(slot, None)
                self.undelivered.pop(slot, None)
                self.cutting.discard(slot)
                if fence:
                    self.fenced[slot] = (name, now + self.cfg.fence_s)
        self.events.append((now, name, why))

    def _account(self, now: float) -> None:
        dt, self._accounted = now - (self._accounted or now), now
        for holder in self.owner.values():
            if holder in self.pipelines:
                self.pipelines[holder].served_s += dt

    def _expire(self, now: float) -> None:
        for name, p in list(self.pipelines.items()):
            if now - p.last_seen > self.cfg.heartbeat_timeout_s:
                why = f"dropped: silent for {now - p.last_seen:.1f}s"
                self.leave(name, now=now, why=why, fence=True)
        for slot, (_, until) in list(self.fenced.items()):
            if now >= until:
                del self.fenced[slot]

    def report(
        self,
        name: str,
        *,
        demand: int,
        version: int,
        now: float,
        inflight: int = 0,
        load: Mapping[int, int] | None = None,
    ) -> dict[str, Any]:
        """A heartbeat with the pipeline's demand (samples it can use and has not started),
        its samples in flight and its running requests per slot; returns what it must do:
        `serve` (its slots now), `give_up` (slots to put to sleep, then `released`: those in
        `cut` at once, the others after their running requests finished or `drain_s`), `take`
        (slots granted to it since its last report, in its report or another's: wake, sync,
        serve)."""
        self._account(now)
        self._expire(now)
        p = self.pipelines.get(name)
        if p is None:
            raise KeyError(f"pipeline {name!r} is not joined (dropped after a silence?)")
        p.demand, p.inflight, p.version = max(0, int(demand)), max(0, int(inflight)), version
        p.load = {int(s): int(n) for s, n in (load or {}).items()}
        self._timed_handovers(name, now)
        if self.cfg.demand_window_s > 0:
            dt, window = now - p.last_seen, self.cfg.demand_window_s
            p.need_avg, p.sustained = sustain(p.need_avg, p.sustained, slot_need(p), dt, window)
        p.last_seen = now
        self.gathered = self.gathered or len(self.pipelines) >= self.cfg.min_pipelines
        if not self.gathered:
            return {"serve": [], "give_up": [], "cut": [], "take": [], "drain_s": 0.0}
        self._apply(now)
        serve = [s for s, h in self.owner.items() if h == name and s not in self.giving_up]
        give_up = [s for s, h in self.giving_up.items() if h == name]
        mine = [s for s, h in self.undelivered.items() if h == name]
        for slot in mine:  # one given up before it was delivered sleeps already: no wake
            del self.undelivered[slot]
        take = [s for s in mine if s not in self.giving_up]
        return {
            "serve": sorted(serve),
            "give_up": sorted(give_up),
            "cut": sorted(s for s in give_up if s in self.cutting),
            "take": sorted(take),
            "drain_s": self.cfg.drain_timeout_s,
        }

    def _timed_handovers(self, name: str, now: float) -> None:
        """A slot `name` now serves on (it is in its load: woken, synced, routed) that was
        being handed over: the hand-over's seconds (`handover_s`)."""
        for slot in self.pipelines[name].load:
            if slot in self.switching and self.owner.get(slot) == name:
                self.handover_s = now - self.switching.pop(slot)
                self.events.append(
                    (now, name, f"serves slot {slot}: hand-over {self.handover_s:.2f}s")
                )

    def _eligible(self) -> Mapping[str, PipelineState]:
        """The pipelines as `plan_slots` sees them: without the slots of other pipelines'
        trainers unless `overlap_others`."""
        if self.cfg.overlap_others or not self.trainer_of:
            return self.pipelines
        return {
            n: dataclasses.replace(
                p, slots=tuple(s for s in p.slots if self.trainer_of.get(s, n) == n)
            )
            for n, p in self.pipelines.items()
        }

    def _sustained(self) -> dict[str, int] | None:
        if self.cfg.demand_window_s <= 0:
            return None
        return {n: p.sustained for n, p in self.pipelines.items()}

    def _trainer_busy(self) -> set[int]:
        return {s for s, n in self.trainer_of.items() if n in self.training}

    def _apply(self, now: float) -> None:
        plan = plan_slots(
            self._eligible(),
            self.owner,
            self.since,
            leaving=set(self.giving_up),
            blocked=set(self.fenced) | self._trainer_busy(),
            now=now,
            min_hold_s=self.cfg.min_hold_s,
            spread=self.cfg.spread,
            trainer_of=self.trainer_of,
            sustained=self._sustained(),
            training=set(self.training),
            quantum_s=self.cfg.rotation_quantum * self.handover_s,
        )
        for slot, want in plan.grant.items():
            self.owner[slot], self.since[slot] = want, now
            self.undelivered[slot] = want
            lent = " (lent: nobody needs it)" if slot in plan.lent else ""
            self.events.append((now, want, f"granted slot {slot}{lent}"))
        for slot, cut in plan.give_up.items():
            holder = self.owner[slot]
            assert holder is not None
            self.giving_up[slot] = holder
            self.asked[slot] = now
            if cut:
                self.cutting.add(slot)
            how = "at once" if cut else "after a drain"
            self.events.append((now, holder, f"asked to give up slot {slot} {how}"))

    def before_training(self, name: str, *, now: float) -> dict[str, Any]:
        """`name`'s trainer is about to train (a heartbeat too): its trainer slots are granted
        to nobody until `after_training`, and the engine on each is to be cut and put to sleep
        at once (its holder is told in its next report; `name`'s own are in this answer's
        `give_up`, all in `cut`). Called again until `wait` is empty: the trainer may take its
        slots only then (no engine awake there, no dropped pipeline's fence on them)."""
        p = self.pipelines.get(name)
        if p is None:
            raise KeyError(f"pipeline {name!r} is not joined (dropped after a silence?)")
        p.last_seen = now
        mine = self.cfg.trainer_slots.get(name, ())
        if mine and name not in self.training:
            self.training[name] = now
            self.events.append((now, name, f"trainer takes slots {list(mine)}"))
        for slot in mine:
            holder = self.owner[slot]
            if holder is not None and self.giving_up.get(slot) != holder:
                self.giving_up[slot] = holder
                self.events.append((now, holder, f"asked to give up slot {slot} at once (trainer)"))
            if holder is not None:
                self.cutting.add(slot)
        fenced = {s for s, (n, _) in self.fenced.items() if n != name}
        give_up = sorted(s for s in mine if self.owner[s] == name)
        return {
            "wait": sorted(s for s in mine if self.owner[s] is not None or s in fenced),
            "give_up": give_up,
            "cut": give_up,
        }

    def after_training(self, name: str, *, now: float) -> None:
        """`name`'s trainer released its slots (its step is done, its state offloaded): they
        may serve generation again, its own engines first."""
        if self.training.pop(name, None) is None:
            return
        self.events.append((now, name, "trainer gives back its slots"))
        if name in self.pipelines and self.gathered:
            self.pipelines[name].last_seen = now
            self._apply(now)

    def released(self, name: str, slot: int, *, now: float) -> None:
        """`name`'s engine on `slot` sleeps: the slot is free for the next grant."""
        if self.owner.get(slot) == name:
            self.owner[slot] = None
            self.giving_up.pop(slot, None)
            self.undelivered.pop(slot, None)
            self.cutting.discard(slot)
            if slot in self.asked:  # a hand-over: timed until the next holder serves there
                self.switching[slot] = self.asked.pop(slot)
            self.events.append((now, name, f"released slot {slot}"))

    def state(self) -> dict[str, Any]:
        return {
            "owner": dict(self.owner),
            "giving_up": dict(self.giving_up),
            "fenced": dict(self.fenced),
            "training": dict(self.training),
            "pipelines": {n: dataclasses.asdict(p) for n, p in self.pipelines.items()},
            "events": list(self.events),
            "served_s": {
                n: self.served_before.get(n, 0.0)
                + (self.pipelines[n].served_s if n in self.pipelines else 0.0)
                for n in {*self.served_before, *self.pipelines}
            },
        }
