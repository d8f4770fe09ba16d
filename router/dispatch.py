"""Late binding: when each request is bound to an engine, and the router-side queue in between.

Owns: `Dispatcher` (`acquire` / `release`, the queue of requests waiting for engine room, the
binding accounting on `Worker`), `DispatchStats`.
Rule (docs/router-policy.md, "Late binding"): with `worker_capacity_tokens` C > 0 an engine
has room while its outstanding expected tokens are below C. A request that finds room on some
healthy engine is bound at once (the policy chooses among engines with room); otherwise it
waits in the router's queue and is bound the moment an engine gets room (a request there
finished, an engine was admitted). The queue is served in priority order:
retries first, then larger `X-Expected-Tokens` first (longest-processing-time order), then
arrival order. A request expecting 0 tokens (info routes) never waits. C = 0 binds every
request on arrival (the policy alone decides).
Invariants: a request is bound to at most one engine at a time; every bind is matched by
exactly one `release` (also when the client disconnects while the request waits or just after
it was bound); a waiting request is either bound, or answered 503 after `wait_for_worker_s`
with no healthy engine, never dropped silently.
Must never import: `slime_async`, aiohttp, or the proxy/health/server modules.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from router.affinity import GroupAffinity
from router.policies import Policy
from router.workers import Worker, WorkerRegistry


@dataclass(slots=True)
class DispatchStats:
    """Queue counters (exported by `/metrics`)."""

    bound_at_once: int = 0
    """Requests that found engine room on arrival."""
    queued: int = 0
    """Requests that waited in the router's queue for engine room."""
    queue_peak: int = 0
    """Largest queue length seen."""
    queue_abandoned: int = 0
    """Queued requests whose client went away before they were bound."""
    queue_timeouts: int = 0
    """Queued requests answered 503 because no engine was healthy for `wait_for_worker_s`."""


@dataclass(order=True, slots=True)
class _Waiter:
    key: tuple[int, int, int]
    """(0 for a retry else 1, -expected tokens, arrival sequence): heap order."""
    expected: int = field(compare=False)
    exclude: frozenset[str] = field(compare=False)
    future: asyncio.Future = field(compare=False)
    group: str | None = field(default=None, compare=False)
    gone: bool = field(default=False, compare=False)


class Dispatcher:
    """Binds requests to engines, immediately or from the router's queue.

    Example (C = 100 expected tokens per engine, one engine; room = outstanding < C):
        acquire(80) -> bound at once (0 < 100), outstanding 80
        acquire(50) -> bound at once (80 < 100), outstanding 130
        acquire(30) -> waits (130 >= 100); release of the 80 -> 50 < 100 -> bound
    """

    def __init__(
        self,
        *,
        registry: WorkerRegistry,
        policy: Policy,
        capacity_tokens: int,
        wait_for_worker_s: float,
        affinity: GroupAffinity | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.affinity = affinity
        """Keeps a group's requests on one engine within a balance bound (router/affinity.py)."""
        self.capacity = capacity_tokens
        self.wait_for_worker_s = wait_for_worker_s
        self.stats = DispatchStats()
        self._heap: list[_Waiter] = []
        self._live = 0
        """Waiters in the heap that are not `gone` (the queue length)."""
        self._seq = itertools.count()
        self._starved: asyncio.TimerHandle | None = None
        registry.on_healthy.append(self.pump)

    @property
    def queue_length(self) -> int:
        """Requests waiting for engine room now."""
        return self._live

    def has_room(self, w: Worker) -> bool:
        """True when `w` may take one more request now."""
        return self.capacity <= 0 or w.outstanding_tokens < self.capacity

    def _select(self, roomy: Sequence[Worker], expected: int, group: str | None) -> Worker:
        if self.affinity is None:
            return self.policy.select(roomy, expected_tokens=expected)
        return self.affinity.choose(self.policy, roomy, expected_tokens=expected, key=group)

    def _bind(self, w: Worker, expected: int) -> Worker:
        w.outstanding_requests += 1
        w.outstanding_tokens += expected
        return w

    def release(self, w: Worker, expected: int) -> None:
        """The request bound to `w` is over (answered, failed or abandoned): free its room."""
        w.outstanding_requests -= 1
        w.outstanding_tokens -= expected
        if self._live:
            self.pump()

    async def acquire(
        self,
        candidates: Sequence[Worker],
        expected: int,
        *,
        exclude: Collection[str] = (),
        retry: bool = False,
        group: str | None = None,
    ) -> Worker | None:
        """Bind a request expecting `expected` tokens to an engine and return it; None when it
        waited and no engine was healthy for `wait_for_worker_s` (answer 503).

        `candidates` are the healthy engines the caller may use right now (already without
        `exclude` where possible); `exclude` (engines this request failed on) is re-applied
        when binding from the queue, falling back to every healthy engine. `group`: the GRPO
        group the request belongs to (`router.affinity.group_key`), or None.
        """
        if not self._live or expected <= 0:
            if self.capacity <= 0 or expected <= 0:
                roomy = candidates
            else:
                roomy = [w for w in candidates if w.outstanding_tokens < self.capacity]
            if roomy:
                # No await between choosing and counting: atomic on the event loop.
                self.stats.bound_at_once += 1
                return self._bind(self._select(roomy, expected, group), expected)
        waiter = _Waiter(
            (0 if retry else 1, -expected, next(self._seq)),
            expected,
            frozenset(exclude),
            asyncio.get_running_loop().create_future(),
            group=group,
        )
        heapq.heappush(self._heap, waiter)
        self._live += 1
        self.stats.queued += 1
        self.stats.queue_peak = max(self.stats.queue_peak, self._live)
        self.pump()  # an engine may have room for this one (e.g. all room went to `exclude`)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                w = waiter.future.result()  # bound, but the client left before we resumed
                if w is not None:
                    self.release(w, expected)
            elif not waiter.gone:
                waiter.gone = True
                self._live -= 1
                self.stats.queue_abandoned += 1
            raise

    def pump(self) -> None:
        """Bind queued requests, in priority order, while some healthy engine has room."""
        heap = self._heap
        while heap:
            top = heap[0]
            if top.gone:
                heapq.heappop(heap)
                continue
            healthy = self.registry.healthy()
            if not healthy:
                self._arm_starvation_timer()
                return
            cands = [w for w in healthy if w.id not in top.exclude] if top.exclude else healthy
            roomy = [w for w in cands or healthy if self.has_room(w)]
            if not roomy:
                return
            heapq.heappop(heap)
            top.gone = True
            self._live -= 1
            top.future.set_result(
                self._bind(self._select(roomy, top.expected, top.group), top.expected)
            )

    def _arm_starvation_timer(self) -> None:
        if self._starved is None:
            loop = asyncio.get_running_loop()
            self._starved = loop.call_later(self.wait_for_worker_s, self._starvation_check)

    def _starvation_check(self) -> None:
        """No engine was healthy for `wait_for_worker_s` while requests waited: answer them."""
        self._starved = None
        if self.registry.healthy():
            self.pump()
            return
        for waiter in self._heap:
            if not waiter.gone:
                waiter.gone = True
                self.stats.queue_timeouts += 1
                waiter.future.set_result(None)
        self._heap.clear()
        self._live = 0
