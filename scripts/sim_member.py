"""`PipelineMember` mirrored in virtual time for `simulate_pipelines.py`: one pipeline's
membership in the REAL `SchedulerCore`.

Every `heartbeat_s` it reports the pipeline's demand, its samples in flight and its running
requests per slot, and starts the hand-overs the answer asks for, each slot's in its own task
(a slot's tasks run one after another), so the reports never wait on a switch: a slot to give
up leaves the rotation, drains (its running requests finish, up to the answer's `drain_s`;
none when it is in `cut`), has the rest cut (each sent whole to another of the pipeline's
engines, or queued), sleeps (`sleep_s`) and is released; a slot taken wakes (`wake_s`) and
gets the pipeline's current version (`sync_s`) before it serves. A member with no answer for
`heartbeat_timeout_s` puts all its engines to sleep on its own (the fence); a dropped one,
once they sleep, joins again. `PoolConfig.stall` makes a member's reports hang for a while
(a test of the drop, the fence and the re-join). Partial overlap: `before_training` and
`after_training` around each train step, as the live member's trainer hooks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from slime_async.orchestrator.pipeline_core import SchedulerCore
from slime_async.orchestrator.pipeline_policy import generation_demand, generation_inflight


class SimMember:
    """The member side of one simulated pipeline (`pipe`: a `simulate_pipelines.Pipeline`)."""

    def __init__(
        self, pipe: Any, core: SchedulerCore, pool_cfg: Any, slots: list[int] | None = None
    ) -> None:
        self.pipe, self.core, self.cfg = pipe, core, pool_cfg
        self.name, self.pool, self.r = pipe.name, pipe.pool, pipe.r
        self.slots = list(range(self.pool.n)) if slots is None else list(slots)
        """The slots it has engines on (every slot of the pool unless given)."""
        self.ops: dict[int, asyncio.Task] = {}
        self.leaving: set[int] = set()
        self.fencing = False
        self.granted_before = 0.0

    def join(self, now: float) -> None:
        prio = self.cfg.priorities[ord(self.name) - ord("a")] if self.cfg.priorities else 1.0
        self.core.join(
            self.name, priority=prio, slots=self.slots, now=now, capacity=self.pool.concurrency
        )

    def _stalled(self, now: float) -> bool:
        stall = self.cfg.stall
        return stall is not None and stall[0] == self.name and stall[1] <= now < stall[2]

    async def run(self) -> None:
        """Report, act, every heartbeat; fence when unanswered; join again when dropped."""
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while True:
            now = loop.time()
            if not self._stalled(now):
                try:
                    todo = self._report(now)
                except KeyError:  # dropped: every engine asleep first, then join again
                    self.r.dropped_at = now
                    await self._fence()
                    self.granted_before = self.r.granted_s
                    self.join(loop.time())
                    self.r.rejoins += 1
                    last_ok, self.fencing = loop.time(), False
                    continue
                last_ok = now
                self._act(todo)
            elif not self.fencing and now - last_ok > self.cfg.heartbeat_timeout_s:
                self._start_fence()
            self.pool.feed(self.name, loop.time())
            await asyncio.sleep(self.cfg.heartbeat_s)

    def _report(self, now: float) -> dict[str, Any]:
        m = self.pipe.worker.metrics()
        todo = self.core.report(
            self.name,
            demand=generation_demand(m, self.pipe.cfg.n),
            inflight=generation_inflight(m),
            load={e: self.pool.active[e] for e in self.pool.serving[self.name]},
            version=self.pipe.version,
            now=now,
        )
        self.r.granted_s = self.granted_before + self.core.pipelines[self.name].served_s
        return todo

    def _op(self, slot: int, coro: Coroutine) -> None:
        """Run `coro` for `slot` after the slot's earlier tasks."""
        prev = self.ops.get(slot)

        async def chained() -> None:
            if prev is not None:
                await asyncio.wait([prev])
            await coro

        self.ops[slot] = asyncio.get_running_loop().create_task(chained())

    def _act(self, todo: dict[str, Any]) -> None:
        now = asyncio.get_running_loop().time()
        for slot in todo["give_up"]:
            if slot not in self.leaving:
                self.leaving.add(slot)
                self._op(slot, self._give_up(slot, slot in todo["cut"], todo["drain_s"]))
        for slot in todo["take"]:
            self.r.switches += 1
            busy = slot in self.ops and not self.ops[slot].done()
            if not (self.cfg.wake_s or self.cfg.sync_s or busy):
                self.pool.serve(slot, self.name, now, feed=False)  # free switch: at once
            else:
                self._op(slot, self._take(slot))

    async def _give_up(self, slot: int, cut: bool, drain_s: float) -> None:
        loop, pool = asyncio.get_running_loop(), self.pool
        pool.drain(slot)
        deadline = loop.time() + (0.0 if cut else drain_s)
        while pool.active[slot] and loop.time() < deadline and not self.fencing:
            await asyncio.sleep(min(self.cfg.heartbeat_s, deadline - loop.time()))
        await self._sleep(slot)
        self.core.released(self.name, slot, now=loop.time())
        self.leaving.discard(slot)
        self.r.switches += 1

    async def _sleep(self, slot: int) -> None:
        """Cut what still runs there, then sleep the engine (if it is awake)."""
        loop, pool = asyncio.get_running_loop(), self.pool
        if pool.holder[slot] == self.name:
            pool.stop_serving(slot, loop.time())
        if self.name in pool.resident[slot]:
            pool.start_switch(slot, loop.time())
            if self.cfg.sleep_s:
                await asyncio.sleep(self.cfg.sleep_s)
            pool.asleep(slot, self.name, loop.time())

    async def _take(self, slot: int) -> None:
        loop, pool = asyncio.get_running_loop(), self.pool
        pool.load(slot, self.name)  # its memory is taken from the start of the wake
        pool.start_switch(slot, loop.time())
        for cost in (self.cfg.wake_s, self.cfg.sync_s):
            if cost:
                await asyncio.sleep(cost)
        core = self.core
        if core.owner.get(slot) == self.name and slot not in core.giving_up and not self.fencing:
            pool.serve(slot, self.name, loop.time())
        # else: given up (or dropped) before it served: the task chained after it sleeps it

    def _start_fence(self) -> None:
        """No answer for `heartbeat_timeout_s`: put every engine of it to sleep on its own."""
        self.fencing = True
        self.r.fences += 1
        for slot in self.slots:
            self._op(slot, self._sleep(slot))

    async def _fence(self) -> None:
        if not self.fencing:
            self._start_fence()
        await asyncio.gather(*self.ops.values(), return_exceptions=False)
        self.ops.clear()
        self.leaving.clear()

    async def before_training(self) -> None:
        """`PipelineMember.before_training`: its own engines on its trainer slots cut and put
        to sleep, the others' by their members at their next report; returns once none is
        resident there (the scheduler's `wait` is empty)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while True:
            try:
                todo = self.core.before_training(self.name, now=loop.time())
            except KeyError:  # dropped: `run` fences and joins again
                todo = {"give_up": [], "wait": [None]}
            for slot in todo["give_up"]:
                if slot not in self.leaving:
                    self.leaving.add(slot)
                    self._op(slot, self._give_up(slot, True, 0.0))
            if not todo["wait"]:
                break
            await asyncio.sleep(self.cfg.heartbeat_s)
        self.r.trainer_wait_s += loop.time() - t0

    def after_training(self) -> None:
        """`PipelineMember.after_training`: its trainer slots given back, reported at once."""
        now = asyncio.get_running_loop().time()
        self.core.after_training(self.name, now=now)
        if self.name in self.core.pipelines and not self._stalled(now):
            self._act(self._report(now))
