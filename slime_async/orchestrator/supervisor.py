"""Engine supervision: restart engines that die or hang, stop cleanly when none come back.

Owns `EngineSupervisor` and `EnginesDownError` (its config, `SupervisorConfig`, is the config
wing's: `slime_async.config.supervision`). The router
already keeps requests safe while an engine is sick (quarantine after failed probes, retries of
requests that never got a byte, requests wait for a healthy engine); this loop repairs the fleet
through the engine backend (`Cluster.backend`, the protocol in `slime_async.contracts.engine`):

* with a backend that can restart engines (embedded, sglang): an engine its backend reports gone
  (`alive()` false: actor or server process dead, or wedged) is replaced at once; one the router
  has marked unhealthy for longer than `restart_after_s` is first asked for a 1-token
  generation itself (`/health_generate`, waiting `hung_timeout_s`): one that answers is slow,
  not hung (the router's probes time out after seconds; a loaded node or a long prefill passes
  that), is counted in `engines/slow_spared` and looked at again after another
  `restart_after_s`; one that does not answer (hung, or serving errors) is stopped and replaced;
* a replacement starts from the weights the engines currently serve (`current_weights()`: the
  newest pushed directory and its version), and is registered with the router only once it is
  up (the router replays weight calls it missed before admitting it), so it never serves stale
  weights; the dead one is deregistered;
* where no directory holds the fleet's weights (the distributed transport: a replacement starts
  on the run's start weights, older than `fleet_version()`), the replacement is held out of the
  router (`Cluster.pending`, watched only for being alive) and `behind` is set: the run sends it
  the fleet's version and registers it (`Run.catch_up_replacements`, docs/weight-sync.md);
* with a backend that cannot restart engines (external servers): nothing is replaced; an
  unhealthy engine is reported once, and the router re-admits it (after replaying the weight
  calls it missed) when its `/health` answers again;
* either way, with no healthy engine a clear line is logged every `log_every_s`; after
  `all_down_timeout_s` `failed` is set with the reason and the controller stops the run with a
  checkpoint (`EnginesDownError`); a replacement that comes up restarts that clock (its own
  start, minutes on a loaded node, is progress, not an outage to count against it);
* an engine dropped for good (its node lost, no live node with room) that was the last one
  leaves nothing to wait for: `failed` is set at once, naming the node.

Never imports a backend implementation or the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from slime_async.config.supervision import SupervisorConfig
from slime_async.orchestrator.roles import Cluster

log = logging.getLogger(__name__)


class EnginesDownError(RuntimeError):
    """No engine could serve for longer than the configured timeout."""


class EngineSupervisor:
    """Background task that keeps `cluster.engines` serving (see module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        cfg: SupervisorConfig,
        *,
        current_weights: Callable[[], tuple[Path, int]],
        fleet_version: Callable[[], int] | None = None,
        on_replace: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.cluster, self.cfg, self.current_weights = cluster, cfg, current_weights
        self.fleet_version = fleet_version
        """The version the admitted engines serve (None: always `current_weights()`'s)."""
        self._on_replace = on_replace
        self.behind = asyncio.Event()
        """Set when a replacement started on older weights than the fleet's (it is pending)."""
        self.failed = asyncio.Event()
        self.reason = ""
        self.restarts = 0
        self.dropped = 0
        """Engines taken out for good (their node lost, no room elsewhere)."""
        self.slow_spared = 0
        """Times an engine the router held unhealthy answered a generation itself: not
        restarted."""
        self._unhealthy_since: dict[str, float] = {}
        self._reported: set[str] = set()
        self._all_down_since: float | None = None
        self._last_log = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="engine-supervisor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    def metrics(self) -> dict[str, float]:
        return {
            "engines/restarts": float(self.restarts),
            "engines/dropped": float(self.dropped),
            "engines/slow_spared": float(self.slow_spared),
        }

    async def _loop(self) -> None:
        while not self.failed.is_set():
            try:
                await self.check()
            except Exception as e:  # a failed check must not kill supervision
                log.warning("engine supervisor check failed: %s", e)
            await asyncio.sleep(self.cfg.interval_s)

    async def check(self) -> None:
        """One pass: find dead/hung engines, replace them (if the backend can), track the
        all-down timeout."""
        now = time.monotonic()
        workers = await self.cluster.control.list_workers()
        healthy = {w["url"]: bool(w["is_healthy"]) for w in workers}
        state = {w["url"]: w.get("state") for w in workers}
        for i, url in enumerate(list(self.cluster.engine_urls)):
            if not await self._look_at(i, url, healthy.get(url, False), state.get(url), now):
                return  # the fleet shrank: indices moved, look again next pass
        self._track_all_down(healthy, state)

    async def _look_at(
        self, i: int, url: str, healthy: bool, state: str | None, now: float
    ) -> bool:
        """Engine `i`: replaced when dead, or hung past `restart_after_s`; False when a
        replacement dropped it instead (the fleet shrank)."""
        if url in self.cluster.asleep or state == "sleeping":  # asleep by design
            self._unhealthy_since.pop(url, None)
            return True
        if url in self.cluster.pending:  # not in the router yet: only its process counts
            if await self.cluster.engine_alive(i):
                return True
            return await self._replace(i, "its process is gone (while waiting for weights)")
        if healthy:
            self._unhealthy_since.pop(url, None)
            self._reported.discard(url)
            return True
        since = self._unhealthy_since.setdefault(url, now)
        if not self.cluster.backend.can_restart:
            if state == "quarantined" and url not in self._reported:
                self._reported.add(url)
                log.warning(
                    "engine %d at %s is quarantined; its backend (%s) cannot restart engines: "
                    "waiting for the router to re-admit it once /health answers again",
                    i,
                    url,
                    type(self.cluster.backend).__name__,
                )
            return True
        if await self.cluster.engine_alive(i):
            if now - since < self.cfg.restart_after_s:
                return True
            why = await self._hung(i, url, now - since)
            if why is None:
                return True
        else:
            why = "its process is gone"
        return await self._replace(i, why)

    async def _hung(self, i: int, url: str, unhealthy_s: float) -> str | None:
        """Why engine `i`, running but unhealthy to the router for `unhealthy_s`, is hung; None
        when it answers a 1-token generation itself (slow, not hung: spared, and looked at
        again after another `restart_after_s`)."""
        problem = await self._generates(url)
        if problem is not None:
            return f"unhealthy for {unhealthy_s:.0f}s and {problem}"
        self.slow_spared += 1
        self._unhealthy_since[url] = time.monotonic()
        log.warning(
            "engine %d at %s: unhealthy to the router for %.0fs, but it answered a 1-token "
            "generation within %.0fs: slow, not hung; not restarting it",
            i,
            url,
            unhealthy_s,
            self.cfg.hung_timeout_s,
        )
        return None

    def _track_all_down(self, healthy: dict[str, bool], state: dict[str, Any]) -> None:
        """The all-down clock: started when no engine serves, `failed` after
        `all_down_timeout_s` (read after any replacement of this pass, which may take minutes)."""
        now = time.monotonic()
        up = [u for u in self.cluster.engine_urls if healthy.get(u, False)]
        by_design = [
            u
            for u in self.cluster.engine_urls
            if u in self.cluster.asleep or state.get(u) == "sleeping"
        ]
        if up or by_design:  # an engine that sleeps (its slot serves another run) is not down
            self._all_down_since = None
            return
        self._all_down_since = self._all_down_since or now
        down = now - self._all_down_since
        if now - self._last_log >= self.cfg.log_every_s:
            self._last_log = now
            log.warning(
                "no healthy rollout engine for %.0fs (of %.0fs allowed): generation is waiting; "
                "restarts so far: %d",
                down,
                self.cfg.all_down_timeout_s,
                self.restarts,
            )
        if down >= self.cfg.all_down_timeout_s:
            self.reason = (
                f"all {len(self.cluster.engine_urls)} rollout engines were down for "
                f"{down:.0f}s (limit {self.cfg.all_down_timeout_s:.0f}s) after "
                f"{self.restarts} restarts; stopping with a checkpoint"
            )
            self.failed.set()

    async def _generates(self, url: str) -> str | None:
        """None when the engine at `url` answers `/health_generate` (SGLang's 1-token
        generation; a probe, open without a key) with 200 within `hung_timeout_s`, else what
        went wrong."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.hung_timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as s,
                s.get(f"{url}/health_generate") as r,
            ):
                await r.read()
                if r.status == 200:
                    return None
                return f"/health_generate answered HTTP {r.status}"
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ConnectionError) as e:
            return f"/health_generate got no answer within {self.cfg.hung_timeout_s:.0f}s ({e!r})"

    async def _replace(self, i: int, why: str) -> bool:
        """Replace engine `i`; False when it was dropped instead (its node is lost and no live
        node has room), which shrinks `cluster.engines`."""
        if self.restarts >= self.cfg.max_restarts:
            return True  # the all-down timeout will stop the run with a clear message
        old = self.cluster.engine_urls[i]
        if (node := await self.cluster.lost_node(i)) is not None:
            slot = await self.cluster.relocate(i, timeout_s=self.cfg.relocate_wait_s)
            if slot is None:
                total = len(self.cluster.engines)
                await self.cluster.drop_engine(i)
                self.dropped += 1
                if not self.cluster.engines:  # nothing left to wait for: stop now
                    self.reason = (
                        f"no rollout engine is left: the last one, engine {i} at {old}, was on "
                        f"node {node}, which is lost, and no live node had room for its bundle "
                        f"within {self.cfg.relocate_wait_s:.0f}s; bring the node back or add "
                        "one, then resume"
                    )
                    self.failed.set()
                    return False
                log.warning(
                    "engine %d at %s: its node %s is lost and no live node has room for its "
                    "bundle (waited %.0fs); continuing on %d of %d engines",
                    i,
                    old,
                    node,
                    self.cfg.relocate_wait_s,
                    total - 1,
                    total,
                )
                if self._on_replace is not None:
                    await self._on_replace()
                return False
            log.warning(
                "engine %d: its node %s is lost; starting it on node %s", i, node, slot.node_ip
            )
        path, version = self.current_weights()
        fleet = version if self.fleet_version is None else self.fleet_version()
        log.warning("engine %d at %s: %s; restarting it on weights v%d", i, old, why, version)
        self.restarts += 1
        try:
            url = await self.cluster.replace_engine(
                i, model_dir=path, version=version, admit=version >= fleet
            )
        except Exception as e:
            log.warning("restart of engine %d failed: %s", i, e)
            return True
        self._unhealthy_since.pop(old, None)
        if self._all_down_since is not None:  # it came up: a fresh all-down allowance
            self._all_down_since = time.monotonic()
        if version < fleet:
            log.warning(
                "engine %d replaced: %s -> %s; it holds v%d, the fleet serves v%d: no "
                "generation until a push gives it v%d",
                i,
                old,
                url,
                version,
                fleet,
                fleet,
            )
            self.behind.set()
        else:
            log.info("engine %d replaced: %s -> %s (serving v%d)", i, old, url, version)
        if self._on_replace is not None:
            await self._on_replace()
        return True
