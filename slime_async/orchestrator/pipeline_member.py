"""A run's side of the pipeline scheduler (`--pipeline-scheduler NAME`).

Owns `PipelineMember`: it joins the scheduler with the run's priority, the slots of its
engines (engine i on slot i) and their capacity (concurrent requests per engine), then every
`heartbeat_s` reports the run's generation demand (samples it can still use within its
staleness bound and has not started), its samples in flight and each serving engine's running
requests (the router's count), and starts what the answer asks for, each slot's hand-over in
its own task (a slot's tasks run one after another; the reports never wait on them): a slot to
give up has its engine put to sleep through the router (out of rotation, its running requests
left to finish for up to the answer's `drain_s`, none for a slot in `cut`; the rest aborted
and sent whole to the run's other engines, or held in the router's queue until one is admitted
again) and is confirmed `released`; a slot granted wakes its engine, which then waits out of the
router (`Cluster.pending`) until the run gives it its current version (selective sync). At
start every engine is put to sleep concurrently while the reports already run. With no answer
for the scheduler's `heartbeat_timeout_s` it puts every engine to sleep on its own (the fence:
the scheduler grants a dropped pipeline's slots to others only after `fence_s`); told it was
dropped, it joins again once its engines sleep. Stopping leaves the scheduler, which frees the
run's slots at once. Partial overlap: around each train step (`training`, the trainer hooks)
the run's trainer slots are cleared of engines before the step (`before_training`) and given
back after it (`after_training`). Rules: docs/pipeline-scheduler.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp

from slime_async.engine.sleep import tags_for_level
from slime_async.orchestrator.pipeline_policy import generation_demand, generation_inflight
from slime_async.orchestrator.pipeline_scheduler import scheduler_handle

log = logging.getLogger(__name__)


class PipelineMember:
    """Membership of one run (`Run`) in a pipeline scheduler."""

    def __init__(self, run: Any, *, level: int = 2) -> None:
        """`level`: the sleep level until the join says the scheduler's (`sleep_level`)."""
        cfg = run.cfg
        self.run = run
        self.cfg = cfg.pipeline
        self.name = cfg.pipeline.name or cfg.run_dir.name
        self.tags = tags_for_level(level)
        self.handle: Any = None
        self._task: asyncio.Task | None = None
        self.ops: dict[int, asyncio.Task] = {}
        self.leaving: set[int] = set()
        self.fencing = False
        self.timeout_s = 10.0
        self.last_ok = time.monotonic()
        self.switches = self.rejoins = self.fences = 0
        self.last_demand = 0
        self.trainer_slots: list[int] = []
        """Slots this run's trainer trains on (partial overlap; from the join)."""
        self.trainer_wait_s = 0.0
        self.owes_after = False
        """The trainer gave its slots back and the scheduler has not heard it yet."""
        self._ticking = asyncio.Lock()

    @property
    def cluster(self) -> Any:
        return self.run.cluster

    async def start(self) -> None:
        """Join, put every engine to sleep (concurrently, until a grant), report on a loop."""
        if self.cfg.name is None:
            log.info("derived: --pipeline-name %s (the run directory's name)", self.name)
        self.handle = scheduler_handle(self.cfg.scheduler)
        await self._join()
        for slot in range(len(self.cluster.engine_urls)):
            self._op(slot, self._sleep_slot(slot))
        self._task = asyncio.create_task(self._loop(), name=f"pipeline-{self.name}")

    async def _join(self) -> None:
        n = len(self.cluster.engines)
        capacity = max(1, self.run.worker.cfg.max_inflight // max(1, n))
        answer = await self.handle.join.remote(
            self.name, self.cfg.priority, list(range(n)), capacity
        )
        self.timeout_s, self.last_ok = float(answer["heartbeat_timeout_s"]), time.monotonic()
        self.trainer_slots = list(answer.get("trainer_slots", []))
        self.tags = tags_for_level(int(answer.get("sleep_level", 2)))
        on_trainer = engines_on_trainer_cores(self.run.cfg.trainer_cores, self.cluster.engine_cores)
        if stray := sorted(set(on_trainer) - set(self.trainer_slots)):
            await self.handle.leave.remote(self.name)
            raise RuntimeError(
                f"pipeline {self.name}: engine(s) {stray} sit on the trainer's cores "
                f"{list(self.run.cfg.trainer_cores)} (--trainer-cores) but their slots are not "
                f"its trainer slots {self.trainer_slots}, so they would generate while it "
                "trains: give the scheduler trainer_slots "
                f"{{{self.name!r}: {tuple(on_trainer)}}}, or keep --rollout-cores off the "
                "trainer's cores"
            )

    async def stop(self) -> None:
        for t in [self._task, *self.ops.values()]:
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
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
            "pipeline/rejoins": float(self.rejoins),
            "pipeline/fences": float(self.fences),
            **({"pipeline/trainer_wait_s": self.trainer_wait_s} if self.trainer_slots else {}),
        }

    @contextlib.asynccontextmanager
    async def training(self) -> AsyncIterator[None]:
        """Around a train step (the trainer hooks; no-ops without trainer slots): the trainer
        slots cleared first (`before_training`), given back after a step that returned
        (`after_training`). A step that raised gives nothing back: the run ends, and leaving
        fences its trainer slots (its trainer may still hold them)."""
        await self.before_training()
        yield
        await self.after_training()

    async def before_training(self) -> None:
        """Partial overlap: the engines on this run's trainer slots are cut (their requests
        re-dispatched by their routers: this run's to its other engines), put to sleep and
        released, its own by this call, the others' by their pipelines at their next report;
        returns once no engine is awake there."""
        if not self.trainer_slots:
            return
        t0 = time.monotonic()
        while True:
            try:
                todo = await asyncio.wait_for(
                    self.handle.before_training.remote(self.name), timeout=self.timeout_s
                )
            except TimeoutError:
                raise RuntimeError(
                    f"pipeline {self.name}: the pipeline scheduler {self.cfg.scheduler} did not "
                    f"answer before_training within {self.timeout_s:.0f}s, so its trainer slots "
                    f"{self.trainer_slots} may still hold engines: not training on them"
                ) from None
            except Exception as e:  # dropped: the report loop fences and joins again
                if not (isinstance(e, KeyError) or "is not joined" in str(e)):
                    raise
                todo = {"give_up": [], "wait": [None]}
            for slot in todo["give_up"]:
                if slot not in self.leaving:
                    self.leaving.add(slot)
                    self._op(slot, self._give_up(slot, 0.0))
            if not todo["wait"]:
                break
            await asyncio.sleep(self.cfg.heartbeat_s)
        self.trainer_wait_s += time.monotonic() - t0

    async def after_training(self) -> None:
        """The trainer slots may serve again (this run's engines there first): reported at
        once, so a slot granted back wakes now, not at the next heartbeat."""
        if not self.trainer_slots:
            return
        self.owes_after = True  # until the scheduler heard it (the report loop tries again)
        try:
            await self.tick()
        except Exception as e:
            log.warning("pipeline %s: report after training failed: %s", self.name, e)

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as e:  # one failed report must not end the membership
                log.warning("pipeline %s: report to the scheduler failed: %s", self.name, e)
            if not self.fencing and time.monotonic() - self.last_ok > self.timeout_s:
                log.warning("pipeline %s: no answer for %.0fs: fencing", self.name, self.timeout_s)
                self._start_fence()
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def _load(self) -> dict[int, int]:
        """Running requests per serving engine (the router's count), by slot."""
        slot_of = {u: i for i, u in enumerate(self.cluster.engine_urls)}
        workers = await self.cluster.control.list_workers()
        return {
            slot_of[w["url"]]: int(w["outstanding_requests"])
            for w in workers
            if w["url"] in slot_of
        }

    async def tick(self) -> None:
        """One report; the hand-overs it asks for start in their own tasks."""
        async with self._ticking:  # the loop's and `after_training`'s, one at a time
            await self._tick()

    async def _tick(self) -> None:
        if self.owes_after:  # the trainer gave its slots back: first of all, say so
            await asyncio.wait_for(
                self.handle.after_training.remote(self.name), timeout=self.timeout_s
            )
            self.owes_after = False
        m = self.run.worker.metrics()
        self.last_demand = generation_demand(m, self.run.cfg.rollout.n_samples_per_prompt)
        load = await self._load()
        call = self.handle.report.remote(
            self.name, self.last_demand, self.run.version, generation_inflight(m), load
        )
        try:
            todo = await asyncio.wait_for(call, timeout=self.timeout_s)
        except Exception as e:
            if not (isinstance(e, KeyError) or "is not joined" in str(e)):
                raise
            log.warning("pipeline %s: dropped by the scheduler: fencing, joining again", self.name)
            await self._fence()
            await self._join()
            self.rejoins += 1
            return
        self.last_ok = time.monotonic()
        for slot in todo["give_up"]:
            if slot not in self.leaving:
                self.leaving.add(slot)
                drain = 0.0 if slot in todo["cut"] else float(todo["drain_s"])
                self._op(slot, self._give_up(slot, drain))
        for slot in todo["take"]:
            self._op(slot, self._wake(self.cluster.engine_urls[slot]))

    def _op(self, slot: int, coro: Coroutine) -> None:
        """Run `coro` for `slot` after the slot's earlier tasks."""
        prev = self.ops.get(slot)

        async def chained() -> None:
            if prev is not None:
                await asyncio.wait([prev])
            try:
                await coro
            except Exception as e:
                log.warning("pipeline %s: slot %d: %s", self.name, slot, e)

        self.ops[slot] = asyncio.create_task(chained())

    async def _give_up(self, slot: int, drain_s: float) -> None:
        await self._sleep(self.cluster.engine_urls[slot], drain_s=drain_s)
        await self.handle.released.remote(self.name, slot)
        self.leaving.discard(slot)
        self.switches += 1

    async def _sleep_slot(self, slot: int) -> None:
        await self._sleep(self.cluster.engine_urls[slot])

    def _start_fence(self) -> None:
        """Every engine to sleep on its own (no drain): its slots may be granted to others."""
        self.fencing = True
        self.fences += 1
        for slot in range(len(self.cluster.engine_urls)):
            self._op(slot, self._sleep_slot(slot))

    async def _fence(self) -> None:
        if not self.fencing:
            self._start_fence()
        await asyncio.gather(*self.ops.values())
        self.ops.clear()
        self.leaving.clear()
        self.fencing = False

    async def _sleep(self, url: str, *, drain_s: float = 0.0) -> None:
        """(Let it drain), abort, release (through the router), then out of the router."""
        cluster = self.cluster
        if url in cluster.asleep:
            return
        if url in cluster.pending:  # woken but not yet admitted: not in the router
            await _engine_call(url, "/release_memory_occupation", {"tags": self.tags}, self._token)
            cluster.pending.discard(url)
        else:
            await cluster.control.release_memory_occupation(
                self.tags, worker_urls=[url], drain_s=drain_s
            )
            await cluster.control.remove_worker(url)
        cluster.asleep.add(url)

    async def _wake(self, url: str) -> None:
        """Resume and continue it (a push pauses the engines in place and continues them
        through the router: one put to sleep between the two, out of the router, missed the
        continue and would hold every request), then wait out of the router for the run's
        version (`Cluster.pending`)."""
        cluster = self.cluster
        if self.fencing:  # no answer meanwhile: it stays asleep
            return
        await _engine_call(url, "/resume_memory_occupation", {"tags": self.tags}, self._token)
        await _engine_call(url, "/continue_generation", {}, self._token)
        self.switches += 1
        cluster.asleep.discard(url)
        cluster.pending.add(url)
        self.run.supervisor.behind.set()  # the run pushes its version to it, then admits it

    @property
    def _token(self) -> str | None:
        e = self.run.cfg.engine
        return e.admin_api_key or e.api_key


def engines_on_trainer_cores(
    trainer_cores: tuple[int, ...], engine_cores: list[tuple[int, ...]]
) -> list[int]:
    """The engines (their slots) pinned to any of the trainer's cores (partial overlap: each
    must be a trainer slot). Unpinned roles share nothing known.

    >>> engines_on_trainer_cores((0,), [(0,), (1,)])
    [0]
    """
    return [i for i, c in enumerate(engine_cores) if set(c) & set(trainer_cores)]


async def _engine_call(url: str, path: str, body: dict, token: str | None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + path, json=body, headers=headers) as r,
    ):
        if r.status != 200:
            raise RuntimeError(f"{url}{path} -> HTTP {r.status}: {await r.text()}")
