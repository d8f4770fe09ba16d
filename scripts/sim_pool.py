"""The simulated pool of `simulate_pipelines.py`: engine slots (one accelerator each), who
serves on each, the requests running there and the time accounts (`Pool`), and one pipeline's
engines in it (`PipeEngines`). A slot can drain (out of rotation, its running requests go on)
or stop serving (its running requests are cut and sent whole again). `Pool.resident` is what
is in each accelerator's memory: an engine is resident from the start of its wake to the end
of its sleep, and a second resident engine on one accelerator raises `DoubleOccupancy` (two
engines never share a device); a trainer onloaded onto its device (partial overlap) is
resident there too, as `<pipeline>:trainer`.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import math

import simulate_dispatch as sd


class DoubleOccupancy(RuntimeError):
    """Two pipelines' engines were awake on one accelerator at once."""


class Pool:
    """Engine slots: who serves on each, its running requests, and the time accounts."""

    def __init__(self, n: int, concurrency: int) -> None:
        self.n, self.concurrency = n, concurrency
        self.holder: list[str | None] = [None] * n
        self.resident: list[set[str]] = [set() for _ in range(n)]
        self.double: list[str] = []
        """Every `DoubleOccupancy` raised (a task's exception is not seen by its caller)."""
        self.switching = [False] * n
        self.active = [0] * n
        self.outstanding = [0] * n
        self.running: list[dict[asyncio.Future, asyncio.TimerHandle]] = [{} for _ in range(n)]
        self.serving: dict[str, list[int]] = collections.defaultdict(list)
        self.waiting: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._t = [0.0] * n
        self.busy_s = [0.0] * n
        self.switch_s = [0.0] * n
        self.occupied_s = 0.0
        self.preempted = 0
        self.keep_partial = False
        """What-if (not built): a cut request goes on from its partial output on its next
        engine (a prefill again) instead of being sent whole."""

    def _touch(self, e: int, now: float) -> None:
        dt, self._t[e] = now - self._t[e], now
        if self.switching[e]:
            self.switch_s[e] += dt
        elif self.active[e]:
            self.busy_s[e] += dt
            self.occupied_s += dt * self.active[e] / self.concurrency

    def pick(self, name: str) -> int:
        """The serving slot of `name` with a free place and the fewest expected tokens (-1)."""
        best, best_load = -1, math.inf
        for e in self.serving[name]:
            if self.active[e] < self.concurrency and self.outstanding[e] < best_load:
                best, best_load = e, self.outstanding[e]
        return best

    def occupy(self, e: int, expected: int, now: float) -> None:
        self._touch(e, now)
        self.active[e] += 1
        self.outstanding[e] += expected

    def vacate(self, e: int, expected: int, now: float) -> None:
        self._touch(e, now)
        self.active[e] -= 1
        self.outstanding[e] -= expected
        if self.holder[e] is not None:
            self.feed(self.holder[e], now)

    def feed(self, name: str, now: float) -> None:
        """Hand queued requests of `name` to its free places (the router's queue)."""
        q = self.waiting[name]
        while q:
            e = self.pick(name)
            if e < 0:
                return
            fut, expected = q.popleft()
            if not fut.done():
                self.occupy(e, expected, now)
                fut.set_result(e)

    def load(self, e: int, name: str) -> None:
        """`name`'s engine on `e` starts waking: its memory is taken."""
        if self.resident[e] - {name}:
            self.double.append(
                f"slot {e}: {name}'s engine wakes while {sorted(self.resident[e])} is resident"
            )
            raise DoubleOccupancy(self.double[-1])
        self.resident[e].add(name)

    def serve(self, e: int, name: str, now: float, *, feed: bool = True) -> None:
        self._touch(e, now)
        self.load(e, name)
        self.switching[e], self.holder[e] = False, name
        bisect.insort(self.serving[name], e)
        if feed:
            self.feed(name, now)

    def settle(self, e: int, now: float) -> None:
        """The switch on `e` is over (a trainer onloaded there trains: not an engine's time)."""
        self._touch(e, now)
        self.switching[e] = False

    def start_switch(self, e: int, now: float) -> None:
        self._touch(e, now)
        self.switching[e] = True

    def drain(self, e: int) -> None:
        """Out of rotation: no new request; the running ones go on."""
        name = self.holder[e]
        if name is not None and e in self.serving[name]:
            self.serving[name].remove(e)

    def stop_serving(self, e: int, now: float) -> None:
        """Out of rotation and every running request cut (re-dispatched by its caller)."""
        self._touch(e, now)
        self.drain(e)
        self.holder[e] = None
        for fut, handle in self.running[e].items():
            handle.cancel()
            fut.set_result(False)
        self.preempted += len(self.running[e])
        self.running[e].clear()
        self.active[e] = self.outstanding[e] = 0
        self.switching[e] = True

    def asleep(self, e: int, name: str, now: float) -> None:
        """`name`'s engine on `e` sleeps: its memory is free."""
        self._touch(e, now)
        self.resident[e].discard(name)
        if not self.resident[e]:
            self.switching[e] = False  # idle until granted

    def close(self, now: float) -> None:
        for e in range(self.n):
            self._touch(e, now)


class PipeEngines(sd.Cluster):
    """One pipeline's engines in the pool (its own versions and counters)."""

    def __init__(self, cfg: sd.SimConfig, work: sd.Workload, pool: Pool, name: str) -> None:
        super().__init__(cfg, work)
        self.pool, self.name = pool, name
        self.samples = 0

    async def _slot(self, expected: int, loop: asyncio.AbstractEventLoop) -> int:
        e = self.pool.pick(self.name)
        if e >= 0:
            self.pool.occupy(e, expected, loop.time())
            return e
        fut = loop.create_future()
        self.pool.waiting[self.name].append((fut, expected))
        return await fut

    async def generate(self, request, priority, expected_len):
        c, pool = self.cfg, self.pool
        loop = asyncio.get_running_loop()
        index = request.prompt.index
        todo = self.work.length(index, request.sample_index) - len(request.prefix_ids)
        while True:
            e = await self._slot(expected_len, loop)
            tau = c.tok_base + c.tok_per_req * pool.active[e]
            t0 = loop.time() + c.prefill_s
            duration = c.prefill_s + todo * tau
            fut = loop.create_future()
            pool.running[e][fut] = loop.call_later(duration, fut.set_result, True)
            if await fut:  # False: the slot was given up under it; send it whole again
                break
            if pool.keep_partial:  # the what-if: go on from the tokens it decoded
                todo -= min(todo - 1, max(0, int((loop.time() - t0) / tau)))
        del pool.running[e][fut]
        pool.vacate(e, expected_len, loop.time())
        self.busy_slot_s += duration
        self.tokens += todo
        self.samples += 1
        return sd.GenerationResult(
            output_ids=range(todo),
            token_versions=self._versions(t0, tau, todo),
            payload={"reward": self.work.reward(index, request.sample_index)},
        )
