"""Several RL pipelines on one pool of accelerators, in virtual time: the dispatch simulator
(`simulate_dispatch.py`) with pipelines.

Each pipeline is what `simulate_dispatch.py` simulates for one run (the REAL `RolloutDataWorker`
against simulated engines, a trainer that takes `groups_per_step` groups, trains `train_step_s`
and pushes in place); here several share a pool of engine slots (one accelerator each) beside
their own trainer devices, in one of two arms:

* `exclusive`: pipeline i owns a fixed share of the engine slots for the whole run (equal
  shares, or `PoolConfig.shares`: a static split sized to each pipeline's demand).
* `shared`: every pipeline has an engine on every slot and the REAL `SchedulerCore`
  (`slime_async.orchestrator.pipeline_core`, what the scheduler actor runs) decides who serves
  where, fed every `heartbeat_s` with each pipeline's `generation_demand`,
  `generation_inflight` and running requests per slot by `sim_member.SimMember`, which mirrors
  `PipelineMember` (hand-overs concurrent with the reports: drain, cut, sleep, release; wake,
  selective sync, serve); with `PoolConfig.spread` the core lends the slots nobody needs to
  pipelines whose requests could spread over more engines. The pool itself (`Pool`, `PipeEngines`) is `sim_pool.py`.

Trainer devices are dedicated in both arms, unless `PoolConfig.overlap` (partial overlap):
then each pipeline's trainer devices are pool slots marked as its trainer slots, which serve
generation between its train steps (its own engines there first; the others' with
`overlap_others`), the engines there cut and asleep before each step (the member's
`before_training`, the scheduler's trainer hooks) and the trainer's state swapped on and off
them (`trainer_swap_s`); the scheduler then runs in the exclusive arm too (each pipeline on its
share plus its own trainer devices). An accelerator is idle when its engine runs no request,
while it switches, and a trainer device while its trainer waits for a batch. Used by `scripts/bench_sim_pipelines.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator

import simulate_dispatch as sd
from sim_member import SimMember
from sim_pool import DoubleOccupancy, PipeEngines, Pool

from data_worker import InMemoryPromptSource, RolloutDataWorker
from data_worker.virtual_loop import run_virtual
from slime_async.config.pipeline import (
    DEMAND_WINDOW_S,
    ROTATION_QUANTUM,
    PipelineSchedulerConfig,
)
from slime_async.orchestrator.pipeline_core import SchedulerCore

__all__ = ["DoubleOccupancy", "Pool", "PoolConfig", "PoolResult", "SchedulerCore", "simulate_pool"]


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
    drain_timeout_s: float = 60.0
    fence_s: float = 30.0
    stall: tuple[str, float, float] | None = None
    """(pipeline, from, to): that pipeline's reports hang in [from, to) (its engines go on)."""
    sleep_s: float = 0.0  # abort, drain, release of one engine (level 2: weights to host)
    wake_s: float = 0.0  # resume of one engine (its weights back from host memory)
    sync_s: float = 0.0  # the pipeline's current version into a woken engine (selective)
    horizon_s: float | None = None
    """Stop every pipeline at this simulated time (None: each trains its `steps`)."""
    spread: bool = False
    """The scheduler lends slots nobody needs (`PipelineSchedulerConfig.spread`)."""
    demand_window_s: float = DEMAND_WINDOW_S
    """The scheduler's sustained demand (`PipelineSchedulerConfig.demand_window_s`, its default;
    0: the instant rule alone)."""
    rotation_quantum: float = ROTATION_QUANTUM
    """The scheduler's rotation quantum (`PipelineSchedulerConfig.rotation_quantum`, its
    default; 0: `min_hold_s` alone)."""
    keep_partial: bool = False
    """What-if (not built): a request cut by a hand-over goes on from its partial output."""
    priorities: tuple[float, ...] | None = None
    """Shared arms: each pipeline's priority at the scheduler (None: all 1)."""
    shares: tuple[int, ...] | None = None
    """Exclusive arm: engine slots of each pipeline (None: equal shares, the rest idle)."""
    overlap: bool = False
    """Partial overlap: each pipeline's trainer devices are pool slots too (its trainer slots,
    `PipelineSchedulerConfig.trainer_slots`), serving generation between its train steps; the
    scheduler runs in both arms (exclusive: each pipeline's engines sit only on its share and
    its own trainer devices)."""
    overlap_others: bool = False
    """With `overlap`: other pipelines' engines may serve on a trainer slot too."""
    trainer_swap_s: float = 0.0
    """With `overlap`: the trainer's state (parameters, gradients, optimizer) back onto its
    devices before a step, and off them after it (each way; the new version goes to the CPU
    weight cache meanwhile)."""


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
    """When it learnt the scheduler dropped it (silent for `heartbeat_timeout_s`), if it did."""
    fences: int = 0
    """Times it put all its engines to sleep on its own (no answer for the timeout)."""
    rejoins: int = 0
    trainer_wait_s: float = 0.0
    """Overlap: time its trainer waited for the engines on its devices to sleep."""


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
        self.r = PipeResult(name=name)
        self.member: SimMember | None = None
        self.trainer_slots: list[int] = []
        """Overlap: the pool slots of its trainer's devices (they serve between its steps)."""

    async def train(self) -> None:
        """The trainer of `simulate_dispatch.simulate`: batch, train, push in place."""
        loop, cfg, r = asyncio.get_running_loop(), self.cfg, self.r
        await self.worker.start()
        for k in range(cfg.steps):
            t = loop.time()
            batch = await self.worker.get_batch(cfg.groups_per_step, k)
            r.idle_s += loop.time() - t
            r.staleness.extend(batch.staleness())
            async with self._trainer_devices():
                self.training_since = loop.time()
                await asyncio.sleep(cfg.train_step_s)
                self.training_since = None
                r.train_s += cfg.train_step_s
            self.version = k + 1
            self.engines.set_version(k + 1, loop.time())
            self.worker.set_served_version(k + 1)
            r.steps, r.trained_samples = k + 1, (k + 1) * cfg.groups_per_step * cfg.n
        r.end_s = loop.time()

    @contextlib.asynccontextmanager
    async def _trainer_devices(self) -> AsyncIterator[None]:
        """Overlap: the engines on its trainer's devices cut and asleep first (the member's
        `before_training`), its state onloaded there (`trainer_swap_s`); after the step
        offloaded and the devices given back (`after_training`). Without: nothing."""
        if not self.trainer_slots or self.member is None:
            yield
            return
        loop, pool, swap = asyncio.get_running_loop(), self.pool, self.member.cfg.trainer_swap_s
        await self.member.before_training()
        who = f"{self.name}:trainer"
        for e in self.trainer_slots:
            pool.load(e, who)  # raises DoubleOccupancy if an engine is still resident
            pool.start_switch(e, loop.time())
        await asyncio.sleep(swap)
        for e in self.trainer_slots:
            pool.settle(e, loop.time())
        yield
        for e in self.trainer_slots:
            pool.start_switch(e, loop.time())
        await asyncio.sleep(swap)
        for e in self.trainer_slots:
            pool.asleep(e, who, loop.time())
        self.member.after_training()


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
    engine_slots: int = 0
    """Slots engines can run on (with overlap: the trainer devices too)."""


def trainer_slots(pool_cfg: PoolConfig, names: list[str]) -> dict[str, list[int]]:
    """Overlap: pipeline i's trainer devices, the pool slots after the engine slots."""
    if not pool_cfg.overlap:
        return {}
    t, base = pool_cfg.trainer_devices, pool_cfg.engine_slots
    return {n: list(range(base + i * t, base + (i + 1) * t)) for i, n in enumerate(names)}


def _arm_slots(arm: str, pool_cfg: PoolConfig, names: list[str]) -> dict[str, list[int]]:
    """The slots each pipeline has engines on. Shared: every slot. Exclusive: contiguous shares
    of the engine slots, equal (the remainder idles) or `pool_cfg.shares`. With overlap, the
    trainer slots too (exclusive: its own)."""
    own = trainer_slots(pool_cfg, names)
    if arm == "shared":
        every = list(range(pool_cfg.engine_slots + sum(len(x) for x in own.values())))
        return {n: every for n in names}
    k = pool_cfg.engine_slots // len(names)
    shares = pool_cfg.shares or (k,) * len(names)
    if len(shares) != len(names) or min(shares) < 1 or sum(shares) > pool_cfg.engine_slots:
        raise ValueError(
            f"shares {shares}: one share >= 1 per pipeline ({len(names)}), "
            f"{pool_cfg.engine_slots} slots in all at most"
        )
    start = [sum(shares[:i]) for i in range(len(names))]
    return {n: list(range(b, b + k)) + own.get(n, []) for n, b, k in zip(names, start, shares)}


async def _run_arm(pipes: list[Pipeline], pool: Pool, arm: str, pool_cfg: PoolConfig) -> float:
    loop = asyncio.get_running_loop()
    names = [p.name for p in pipes]
    own = _arm_slots(arm, pool_cfg, names)
    core, sims = None, []
    if arm == "shared" or pool_cfg.overlap:
        mine = trainer_slots(pool_cfg, names)
        core = SchedulerCore(
            PipelineSchedulerConfig(
                slots=pool.n,
                min_hold_s=pool_cfg.min_hold_s,
                heartbeat_timeout_s=pool_cfg.heartbeat_timeout_s,
                drain_timeout_s=pool_cfg.drain_timeout_s,
                fence_s=pool_cfg.fence_s,
                min_pipelines=len(pipes),
                spread=pool_cfg.spread,
                demand_window_s=pool_cfg.demand_window_s,
                rotation_quantum=pool_cfg.rotation_quantum,
                trainer_slots={n: tuple(x) for n, x in mine.items()},
                overlap_others=pool_cfg.overlap_others,
            )
        )
        sims = [SimMember(p, core, pool_cfg, own[p.name]) for p in pipes]
        for p, m in zip(pipes, sims):  # engines asleep until granted (`PipelineMember.start`)
            p.member, p.trainer_slots = m, mine.get(p.name, [])
            m.join(0.0)
    else:
        for name, slots in own.items():
            for e in slots:
                pool.serve(e, name, 0.0)
    trainers = [loop.create_task(p.train(), name=p.name) for p in pipes]
    members = [loop.create_task(m.run()) for m in sims]
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
            p.r.granted_s = sims[pipes.index(p)].granted_before + core.pipelines[p.name].served_s
    pool.close(end)
    ops = [t for m in sims for t in m.ops.values()]
    for t in trainers + members + ops:
        t.cancel()
    await asyncio.gather(*trainers, *members, *ops, return_exceptions=True)
    if pool.double:
        raise DoubleOccupancy(f"{len(pool.double)} times, first: {pool.double[0]}")
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
    extra = pool_cfg.trainer_devices * len(cfgs) if pool_cfg.overlap else 0
    pool = Pool(pool_cfg.engine_slots + extra, slots.pop())
    pool.keep_partial = pool_cfg.keep_partial
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
        engine_slots=pool.n,
    )
