"""Several RL pipelines on one pool of accelerators, in virtual time: the dispatch simulator
(`simulate_dispatch.py`) with pipelines.

Each pipeline is what `simulate_dispatch.py` simulates for one run (the REAL `RolloutDataWorker`
against simulated engines, a trainer that takes `groups_per_step` groups, trains `train_step_s`
and pushes in place); here several share a pool of engine slots (one accelerator each) beside
their own trainer devices, in one of two arms:

* `exclusive`: pipeline i owns a fixed, equal share of the engine slots for the whole run.
* `shared`: every pipeline has an engine on every slot and the REAL `SchedulerCore`
  (`slime_async.orchestrator.pipeline_policy`, what the scheduler actor runs) decides who serves
  where, fed every `heartbeat_s` with each pipeline's `generation_demand` as
  `PipelineMember.tick` does, which it mirrors: a slot to give up has its running requests cut
  (each sent whole to another of the pipeline's serving engines, or queued), its engine sleeps
  (`sleep_s`) and is released; a slot taken wakes (`wake_s`, one after another) and gets the
  pipeline's current version (selective sync, `sync_s`) before it serves.

Trainer devices are dedicated in both arms (the scheduler grants engine slots only). An
accelerator is idle when its engine runs no request, while it switches, and a trainer device
while its trainer waits for a batch. Used by `scripts/bench_sim_pipelines.py`.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import math

import simulate_dispatch as sd

from data_worker import InMemoryPromptSource, RolloutDataWorker
from data_worker.virtual_loop import run_virtual
from slime_async.config.pipeline import PipelineSchedulerConfig
from slime_async.orchestrator.pipeline_policy import SchedulerCore, generation_demand


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PoolConfig:
    """The pool, the scheduler's settings and the mechanism's costs (seconds per switch)."""

    engine_slots: int = 48
    """Accelerators that run engines (one engine each; shared or split between pipelines)."""
    trainer_devices: int = 4
    """Accelerators per pipeline for its trainer (dedicated in both arms)."""
    heartbeat_s: float = 1.0
    min_hold_s: float = 30.0
    heartbeat_timeout_s: float = 10.0
    sleep_s: float = 0.0  # abort, drain, release of one engine (level 2: weights to host)
    wake_s: float = 0.0  # resume of one engine (its weights back from host memory)
    sync_s: float = 0.0  # the pipeline's current version into a woken engine (selective)
    horizon_s: float | None = None
    """Stop every pipeline at this simulated time (None: each trains its `steps`)."""


class Pool:
    """Engine slots: who serves on each, its running requests, and the time accounts."""

    def __init__(self, n: int, concurrency: int) -> None:
        self.n, self.concurrency = n, concurrency
        self.holder: list[str | None] = [None] * n
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

    def serve(self, e: int, name: str, now: float, *, feed: bool = True) -> None:
        self._touch(e, now)
        self.switching[e], self.holder[e] = False, name
        bisect.insort(self.serving[name], e)
        if feed:
            self.feed(name, now)

    def stop_serving(self, e: int, now: float) -> None:
        """Out of rotation and every running request cut (re-dispatched by its caller)."""
        self._touch(e, now)
        name, self.holder[e] = self.holder[e], None
        if name is not None:
            self.serving[name].remove(e)
        for fut, handle in self.running[e].items():
            handle.cancel()
            fut.set_result(False)
        self.preempted += len(self.running[e])
        self.running[e].clear()
        self.active[e] = self.outstanding[e] = 0
        self.switching[e] = True

    def asleep(self, e: int, now: float) -> None:
        self._touch(e, now)
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


@dataclasses.dataclass(kw_only=True, slots=True)
class PipeResult:
    """What one pipeline did in a pool simulation."""

    name: str
    steps: int = 0
    trained_samples: int = 0
    rollout_samples: int = 0
    idle_s: float = 0.0
    train_s: float = 0.0
    end_s: float = 0.0
    staleness: list[int] = dataclasses.field(default_factory=list)
    dropped: int = 0
    slot_util: float = 0.0
    granted_s: float = 0.0
    switches: int = 0
    dropped_at: float | None = None
    """When the scheduler dropped it (silent for `heartbeat_timeout_s`), if it did."""


class Pipeline:
    """One run in the pool: its worker, trainer and (shared arm) scheduler membership."""

    def __init__(
        self, name: str, cfg: sd.SimConfig, pool: Pool, policy: sd.Policy, max_inflight: int
    ) -> None:
        self.name, self.cfg, self.pool = name, cfg, pool
        self.engines = PipeEngines(cfg, sd.Workload(cfg), pool, name)
        wcfg = sd.worker_config(cfg, policy, max_inflight)
        source = InMemoryPromptSource(
            [{"prompt_ids": [i], "key": str(i)} for i in range(cfg.prompts)], num_epochs=None
        )
        self.worker = RolloutDataWorker(wcfg, source, self.engines.generate)
        self.version = 0
        self.training_since: float | None = None
        self.syncs: set[asyncio.Task] = set()
        self.r = PipeResult(name=name)

    async def train(self) -> None:
        """The trainer of `simulate_dispatch.simulate`: batch, train, push in place."""
        loop, cfg, r = asyncio.get_running_loop(), self.cfg, self.r
        await self.worker.start()
        for k in range(cfg.steps):
            t = loop.time()
            batch = await self.worker.get_batch(cfg.groups_per_step, k)
            r.idle_s += loop.time() - t
            r.staleness.extend(batch.staleness())
            self.training_since = loop.time()
            await asyncio.sleep(cfg.train_step_s)
            self.training_since = None
            r.train_s += cfg.train_step_s
            self.version = k + 1
            self.engines.set_version(k + 1, loop.time())
            self.worker.set_served_version(k + 1)
            r.steps, r.trained_samples = k + 1, (k + 1) * cfg.groups_per_step * cfg.n
        r.end_s = loop.time()

    async def member(self, core: SchedulerCore, pool_cfg: PoolConfig) -> None:
        """`PipelineMember`'s loop: report the demand, act on the answer, every heartbeat."""
        loop = asyncio.get_running_loop()
        while True:
            demand = generation_demand(self.worker.metrics(), self.cfg.n)
            try:
                todo = core.report(self.name, demand=demand, version=self.version, now=loop.time())
            except KeyError:  # dropped (silent past the timeout while it switched): out
                self.r.dropped_at = loop.time()
                for slot in list(self.pool.serving[self.name]):
                    self.pool.stop_serving(slot, loop.time())
                    self.pool.asleep(slot, loop.time())
                return
            self.r.granted_s = core.pipelines[self.name].served_s
            for slot in todo["give_up"]:
                self.pool.stop_serving(slot, loop.time())
                if pool_cfg.sleep_s:
                    await asyncio.sleep(pool_cfg.sleep_s)
                self.pool.asleep(slot, loop.time())
                core.released(self.name, slot, now=loop.time())
                self.r.switches += 1
            for slot in todo["take"]:
                self.r.switches += 1
                if not (pool_cfg.wake_s or pool_cfg.sync_s):  # free switches: serve at once
                    self.pool.serve(slot, self.name, loop.time(), feed=False)
                    continue
                self.pool.switching[slot] = True
                if pool_cfg.wake_s:
                    await asyncio.sleep(pool_cfg.wake_s)
                task = loop.create_task(self._sync_then_serve(slot, core, pool_cfg.sync_s))
                self.syncs.add(task)
                task.add_done_callback(self.syncs.discard)
            self.pool.feed(self.name, loop.time())
            await asyncio.sleep(pool_cfg.heartbeat_s)

    async def _sync_then_serve(self, slot: int, core: SchedulerCore, sync_s: float) -> None:
        if sync_s:
            await asyncio.sleep(sync_s)
        if core.owner.get(slot) == self.name and slot not in core.giving_up:
            self.pool.serve(slot, self.name, asyncio.get_running_loop().time())
        else:  # asked to give it up before it served: it goes back to sleep at once
            self.pool.asleep(slot, asyncio.get_running_loop().time())


@dataclasses.dataclass(kw_only=True, slots=True)
class PoolResult:
    """One arm of a pool simulation."""

    arm: str
    sim_s: float
    pipes: list[PipeResult]
    accelerators: int
    engine_busy_s: float
    engine_switch_s: float
    occupied_s: float
    trainer_busy_s: float
    preempted: int


def _arm_slots(arm: str, pool_cfg: PoolConfig, names: list[str]) -> dict[str, list[int]]:
    """Exclusive: equal contiguous shares of the engine slots (the remainder idles)."""
    if arm == "shared":
        return {n: list(range(pool_cfg.engine_slots)) for n in names}
    k = pool_cfg.engine_slots // len(names)
    return {n: list(range(i * k, (i + 1) * k)) for i, n in enumerate(names)}


async def _run_arm(pipes: list[Pipeline], pool: Pool, arm: str, pool_cfg: PoolConfig) -> float:
    loop = asyncio.get_running_loop()
    own = _arm_slots(arm, pool_cfg, [p.name for p in pipes])
    core = None
    if arm == "shared":
        core = SchedulerCore(
            PipelineSchedulerConfig(
                slots=pool_cfg.engine_slots,
                min_hold_s=pool_cfg.min_hold_s,
                heartbeat_timeout_s=pool_cfg.heartbeat_timeout_s,
                min_pipelines=len(pipes),
            )
        )
        for p in pipes:  # every engine asleep until granted, as `PipelineMember.start`
            core.join(p.name, priority=1.0, slots=list(range(pool_cfg.engine_slots)), now=0.0)
    else:
        for name, slots in own.items():
            for e in slots:
                pool.serve(e, name, 0.0)
    trainers = [loop.create_task(p.train(), name=p.name) for p in pipes]
    members = [loop.create_task(p.member(core, pool_cfg)) for p in pipes] if core else []
    if pool_cfg.horizon_s is None:
        await asyncio.gather(*trainers)
        end = max(p.r.end_s for p in pipes)
    else:
        await asyncio.sleep(pool_cfg.horizon_s)
        end = loop.time()
    if core is not None:
        core._account(end)  # slot time up to the horizon
    for p in pipes:
        p.r.rollout_samples = p.engines.samples
        if p.training_since is not None:  # a step under way at the horizon
            p.r.train_s += end - p.training_since
        if core is None:
            p.r.granted_s = len(own[p.name]) * end
        elif p.name in core.pipelines:  # else: what it had at its last report
            p.r.granted_s = core.pipelines[p.name].served_s
    pool.close(end)
    for t in trainers + members:
        t.cancel()
    await asyncio.gather(*trainers, *members, return_exceptions=True)
    for p in pipes:
        await p.worker.stop()
        p.r.dropped = p.worker.accounting().dropped
    return end


DEFAULT_DISPATCH = sd.Policy(name="window 2B + probe", window=math.nan, probe=True)
"""The data worker's defaults: windowed FIFO with W = 2B, length-probe dispatch."""


def simulate_pool(
    arm: str, pool_cfg: PoolConfig, cfgs: list[sd.SimConfig], policy: sd.Policy | None = None
) -> PoolResult:
    """Run `cfgs` (one per pipeline, named a, b, ...) on the pool in `arm` (exclusive/shared);
    each pipeline's data worker dispatches by `policy` (None: the data worker's defaults)."""
    if arm not in ("exclusive", "shared"):
        raise ValueError(f"arm must be 'exclusive' or 'shared', got {arm!r}")
    slots = {c.slots for c in cfgs}
    if len(slots) != 1:
        raise ValueError(f"every pipeline's engines need the same --slots, got {sorted(slots)}")
    pool = Pool(pool_cfg.engine_slots, slots.pop())
    names = [chr(ord("a") + i) for i in range(len(cfgs))]
    share = _arm_slots(arm, pool_cfg, names)
    pipes = []
    for n, c in zip(names, cfgs):
        pol = policy or dataclasses.replace(DEFAULT_DISPATCH, window=2 * c.groups_per_step)
        pipes.append(Pipeline(n, c, pool, pol, max_inflight=len(share[n]) * pool.concurrency))
    end = run_virtual(_run_arm(pipes, pool, arm, pool_cfg))
    for p in pipes:
        p.r.slot_util = p.engines.busy_slot_s / (end * len(share[p.name]) * pool.concurrency)
    return PoolResult(
        arm=arm,
        sim_s=end,
        pipes=[p.r for p in pipes],
        accelerators=pool_cfg.engine_slots + pool_cfg.trainer_devices * len(cfgs),
        engine_busy_s=sum(pool.busy_s),
        engine_switch_s=sum(pool.switch_s),
        occupied_s=pool.occupied_s,
        trainer_busy_s=sum(p.r.train_s for p in pipes) * pool_cfg.trainer_devices,
        preempted=pool.preempted,
    )
