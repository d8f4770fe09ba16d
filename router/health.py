"""Health checking: periodic `/health` probes, quarantine, re-admission with weight catch-up.

Owns: `HealthMonitor` (the probe loop and on-demand probes after a proxied failure).
An engine that comes back after missing weight updates is not re-admitted until the last
weight-changing control calls have been replayed on it (docs/router-policy.md, "Re-admission").
Must never import: `slime_async`, or the proxy/server modules.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp

from router.config import RouterConfig
from router.workers import Worker, WorkerRegistry, WorkerState


class HealthMonitor:
    """Probes every registered engine each `health_interval_s`; drives registry transitions."""

    def __init__(
        self,
        *,
        cfg: RouterConfig,
        registry: WorkerRegistry,
        session: Callable[[], aiohttp.ClientSession],
        catch_up: Callable[..., Awaitable[bool]],
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self._session = session
        self._catch_up = catch_up
        self._probing: dict[str, asyncio.Task] = {}
        self._loop_task: asyncio.Task | None = None
        self._timeout = aiohttp.ClientTimeout(total=cfg.health_timeout_s)
        self.probes = 0
        self.probe_failures = 0

    def start(self) -> None:
        """Start the background probe loop (first round immediately)."""
        self._loop_task = asyncio.create_task(self._run(), name="router-health")

    async def stop(self) -> None:
        """Cancel the loop and any probe in flight."""
        tasks = [t for t in (self._loop_task, *self._probing.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._probing.clear()

    async def _run(self) -> None:
        """Every `health_interval_s`, probe each engine that has no probe in flight: one slow to
        answer (up to `health_timeout_s`) never delays the others' probes."""
        while True:
            for w in self.registry.all():
                self.poke(w)  # skips removed and sleeping engines, and one already probed
            await asyncio.sleep(self.cfg.health_interval_s)

    def poke(self, w: Worker) -> None:
        """Probe `w` soon, outside the periodic schedule (called after a proxied failure)."""
        if w.id not in self._probing and w.state not in (WorkerState.REMOVED, WorkerState.SLEEPING):
            self._probing[w.id] = asyncio.create_task(self._probe(w))
            self._probing[w.id].add_done_callback(lambda _t, i=w.id: self._probing.pop(i, None))

    async def probe_now(self, w: Worker) -> bool:
        """Probe `w` (joining a probe already in flight); True if it answered healthy."""
        task = self._probing.get(w.id)
        if task is None:
            self.poke(w)
            task = self._probing.get(w.id)
        if task is None:
            return False
        return await asyncio.shield(task)

    async def _probe(self, w: Worker) -> bool:
        self.probes += 1
        # A quarantined engine must prove it can generate, not only that its HTTP server is up.
        path = self.cfg.readmit_probe_path if w.state is WorkerState.QUARANTINED else "/health"
        try:
            async with self._session().get(w.url + path, timeout=self._timeout) as r:
                await r.read()
                ok = r.status == 200
                err = "" if ok else f"{path} answered HTTP {r.status}"
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ConnectionError) as e:
            ok, err = False, f"{path} failed: {type(e).__name__}: {e}"
        if not ok:
            self.probe_failures += 1
            self.registry.record_failure(w, err)
            return False
        returning = w.state is WorkerState.QUARANTINED
        if self.registry.record_success(w, admit=False):
            # A returning engine may be a restarted process that lost its weights without
            # missing a call: it gets every logged weight call replayed, not just the missed.
            behind = returning or w.weight_generation < self.registry.weight_generation
            if behind and not await self._catch_up(w, replay_all=returning):
                self.registry.quarantine(w, "weight catch-up failed on re-admission")
                w.consecutive_successes = 0
                return False
            self.registry.admit(w)
        return True
