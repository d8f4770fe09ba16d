"""A run's side of the pipeline scheduler (`--pipeline-scheduler NAME`).

Owns `PipelineMember`: it joins the scheduler with the run's priority and the slots of its
engines (engine i on slot i), then every `heartbeat_s` reports the run's generation demand
(samples it still wants at its current version within its staleness bound: the groups the
staleness budget still admits times the samples per group, plus the samples queued or in
flight) and acts on the answer: a slot to give up has its engine put to sleep through the
router (abort, drain, release: the router sends each cut request whole to the run's other
engines, or, when none serves, holds it in its queue until one is admitted again, within
`--router-wait-for-worker`) and taken out of the router; a slot granted wakes its engine, which then waits out of the router
(`Cluster.pending`) until the run gives it its current version (selective sync: a version is
pushed only to the engines that serve, `Cluster.serving_urls`). Stopping leaves the scheduler,
which frees the run's slots at once; a run that dies without leaving is dropped after the
scheduler's heartbeat timeout. Rules: docs/pipeline-scheduler.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp

from slime_async.engine.sleep import tags_for_level
from slime_async.orchestrator.pipeline_policy import generation_demand
from slime_async.orchestrator.pipeline_scheduler import scheduler_handle

log = logging.getLogger(__name__)


class PipelineMember:
    """Membership of one run (`Run`) in a pipeline scheduler."""

    def __init__(self, run: Any, *, level: int = 2) -> None:
        cfg = run.cfg
        self.run = run
        self.cfg = cfg.pipeline
        self.name = cfg.pipeline.name or cfg.run_dir.name
        self.tags = tags_for_level(level)
        self.handle: Any = None
        self._task: asyncio.Task | None = None
        self.switches = 0
        self.last_demand = 0

    @property
    def cluster(self) -> Any:
        return self.run.cluster

    async def start(self) -> None:
        """Join (every engine asleep until a grant), then report on a loop."""
        if self.cfg.name is None:
            log.info("derived: --pipeline-name %s (the run directory's name)", self.name)
        self.handle = scheduler_handle(self.cfg.scheduler)
        slots = list(range(len(self.cluster.engines)))
        await self.handle.join.remote(self.name, self.cfg.priority, slots)
        for url in list(self.cluster.engine_urls):
            await self._sleep(url)
        self._task = asyncio.create_task(self._loop(), name=f"pipeline-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.handle is not None:
            with contextlib.suppress(Exception):
                await self.handle.leave.remote(self.name)

    def demand(self) -> int:
        return generation_demand(
            self.run.worker.metrics(), self.run.cfg.rollout.n_samples_per_prompt
        )

    def metrics(self) -> dict[str, float]:
        return {
            "pipeline/switches": float(self.switches),
            "pipeline/demand": float(self.last_demand),
            "pipeline/serving_engines": float(len(self.cluster.serving_urls)),
        }

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as e:  # one failed report must not end the membership
                log.warning("pipeline %s: report to the scheduler failed: %s", self.name, e)
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def tick(self) -> None:
        """One report and the hand-overs it asks for."""
        self.last_demand = self.demand()
        todo = await self.handle.report.remote(self.name, self.last_demand, self.run.version)
        urls = self.cluster.engine_urls
        for slot in todo["give_up"]:
            await self._sleep(urls[slot])
            await self.handle.released.remote(self.name, slot)
            self.switches += 1
        for slot in todo["take"]:
            await self._wake(urls[slot])
            self.switches += 1

    async def _sleep(self, url: str) -> None:
        """Abort, drain, release (through the router), then out of the router."""
        cluster = self.cluster
        if url in cluster.asleep:
            return
        if url in cluster.pending:  # woken but not yet admitted: not in the router
            await _engine_call(url, "/release_memory_occupation", self.tags, self._token)
            cluster.pending.discard(url)
        else:
            await cluster.control.release_memory_occupation(self.tags, worker_urls=[url])
            await cluster.control.remove_worker(url)
        cluster.asleep.add(url)

    async def _wake(self, url: str) -> None:
        """Resume, then wait out of the router for the run's version (`Cluster.pending`)."""
        cluster = self.cluster
        await _engine_call(url, "/resume_memory_occupation", self.tags, self._token)
        cluster.asleep.discard(url)
        cluster.pending.add(url)
        self.run.supervisor.behind.set()  # the run pushes its version to it, then admits it

    @property
    def _token(self) -> str | None:
        e = self.run.cfg.engine
        return e.admin_api_key or e.api_key


async def _engine_call(url: str, path: str, tags: list[str], token: str | None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + path, json={"tags": tags}, headers=headers) as r,
    ):
        if r.status != 200:
            raise RuntimeError(f"{url}{path} -> HTTP {r.status}: {await r.text()}")
