"""Ray roles of a run: the router actor, core pinning, and the handle set the controller holds.

Owns `RouterActor`, `init_ray` (join a cluster or start a local node),
`pin_actor` and `Cluster` (the run's engines as backend handles, the router URL + client).
Engines are started, checked, replaced and stopped only through the engine backend protocol
(`slime_async.contracts.engine`); which backend runs them (embedded Ray actors, SGLang servers,
attached external servers, a plugin) is chosen by the caller from the registry in
`slime_async.orchestrator.engines`. A run places trainer ranks and engines in placement-group bundles
(`slime_async.orchestrator.placement`; a local node gets logical CPUs for all of them, so nothing waits on
a 2-core machine, docs/cpu.md); actors outside bundles (the router) take `num_cpus=0`.
Cores are given out explicitly (`pin_cores` inside the process, per node): the CPU analogue of
separate rollout and training GPU pools. See docs/cluster.md.
Never imports the controller, the supervisor or a backend implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from router.client import RouterClient
from router.config import RouterConfig
from slime_async.contracts.engine import EngineBackend, EngineHandle, EngineLaunch
from slime_async.host import huge_page_malloc, pin_cores
from slime_async.orchestrator.placement import Slot, node_alive, relocated

log = logging.getLogger(__name__)

REPLACE_STOP_TIMEOUT_S = 5.0
"""A replaced engine (dead or wedged) gets this long to stop before it is killed."""


def _pin_actor(_actor: object, cores: tuple[int, ...], threads: int | None) -> int:
    pin_cores(cores, threads)
    return os.getpid()


async def pin_actor(
    actor: ray.actor.ActorHandle, cores: tuple[int, ...], threads: int | None = None
) -> int:
    """Pin a running actor's process to `cores` with `threads` torch threads (default: one per
    core); works for any actor class; returns its pid."""
    return await actor.__ray_call__.remote(_pin_actor, cores, threads)


@ray.remote(num_cpus=0)
class RouterActor:
    """The router served from an async Ray actor (the actor's event loop runs aiohttp)."""

    def __init__(self, cfg: RouterConfig) -> None:
        from router.server import Router

        self._router = Router(cfg)

    async def start(self) -> str:
        return await self._router.start()

    async def stop(self) -> None:
        await self._router.stop()


def init_ray(
    *,
    address: str | None = None,
    num_cpus: float | None = None,
    object_store_memory: int | None = None,
) -> bool:
    """Join the Ray cluster at `address` (see `ray_address`), or start a local node quietly (no
    dashboard, `num_cpus` logical CPUs, at least this machine's). A stale
    /tmp/ray/ray_current_cluster never hijacks a local run. A no-op when Ray is already up.
    Returns True when a cluster was joined (servers must then bind their node's IP). A local
    node this process started earlier (a notebook or a test running a second run) that has
    fewer logical CPUs than `num_cpus` is started again, larger, when nothing holds any of it;
    otherwise the run's reservation names what it lacks. `object_store_memory`: the bytes of a
    local node's object store (Ray's default, 30% of the node's memory, when None)."""
    if ray.is_initialized():
        if not _LOCAL[0] or not _too_small_and_idle(num_cpus):
            return not _LOCAL[0]
        log.info("restarting this process's local Ray node with %s logical CPUs", num_cpus)
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    quiet = {"log_to_driver": True, "logging_level": logging.WARNING, "configure_logging": False}
    if address is not None:  # an existing cluster: its nodes say what they have
        ray.init(address=address, **quiet)
        _LOCAL[0] = False
        log.info("joined the Ray cluster at %s: %s", address, ray.cluster_resources())
        return True
    cpus = max(2, os.cpu_count() or 2, math.ceil(num_cpus or 0))
    # the local node's raylet starts workers at this niceness (Ray's default is 15): our actors
    # are the run itself and compete with nothing of ours, so they run at normal priority
    os.environ.setdefault("RAY_worker_niceness", "0")
    # and their heaps on transparent huge pages: a tenth of a train step's page faults
    huge_page_malloc()
    ray.init(
        address="local",
        num_cpus=cpus,
        include_dashboard=False,
        object_store_memory=object_store_memory,
        **quiet,
    )
    _LOCAL[0] = True
    return False


_LOCAL = [True]
"""Whether this process started its own Ray node (set by `init_ray`)."""


def _too_small_and_idle(num_cpus: float | None) -> bool:
    """This process's local node has fewer logical CPUs than `num_cpus`, and every CPU of it
    is free (no actor or placement group holds any)."""
    total = ray.cluster_resources().get("CPU", 0.0)
    if num_cpus is None or total >= num_cpus:
        return False
    deadline = time.monotonic() + 5.0  # a finished run's CPUs come back asynchronously
    while ray.available_resources().get("CPU", 0.0) < total - 1e-6:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@dataclasses.dataclass(kw_only=True)
class Cluster:
    """Live handles of one run's roles: the engines (through their backend) and the router."""

    backend: EngineBackend
    engines: list[EngineHandle]
    router: ray.actor.ActorHandle
    router_url: str
    control: RouterClient
    engine_cores: list[tuple[int, ...]]
    seed: int
    """Base sampling seed; engine i starts with `seed + 1000 i` (restarts add `7 (version + 1)`)."""
    slots: list[Slot] | None = None
    """Engine i's reserved bundle on the cluster (a replacement goes back into it); None: the
    engines run anywhere on the local node."""
    bind_node_ips: bool = False
    """Engines bind their node's IP (a joined cluster) instead of loopback."""
    pending: set[str] = dataclasses.field(default_factory=set)
    """Replacements started on older weights than the fleet serves: up, but not registered
    with the router (no generation) until a push gave them the fleet's version
    (`admit_caught_up`)."""

    asleep: set[str] = dataclasses.field(default_factory=set)
    """Engines put to sleep because the pipeline scheduler gave their slot to another run: out
    of the router, their memory released, no weight push reaches them (they get the run's
    version when they wake: `PipelineMember`)."""

    @property
    def engine_urls(self) -> list[str]:
        return [h.url for h in self.engines]

    @property
    def awake_urls(self) -> list[str]:
        """Engines not asleep (the ones a weight push goes to: selective sync)."""
        return [u for u in self.engine_urls if u not in self.asleep]

    @property
    def serving_urls(self) -> list[str]:
        """Engines in the router: neither asleep nor waiting for the run's version."""
        return [u for u in self.awake_urls if u not in self.pending]

    @property
    def engine_pids(self) -> list[int | None]:
        """Pid serving each engine; None where the backend owns no local process (external)."""
        return [h.pid for h in self.engines]

    @classmethod
    async def start(
        cls,
        *,
        backend: EngineBackend,
        num_engines: int,
        model_dir: str | Path,
        version: int,
        seed: int,
        router_cfg: RouterConfig,
        rollout_cores: tuple[int, ...],
        slots: list[Slot] | None = None,
        bind_node_ips: bool = False,
        pin_slot_cores: bool = False,
        router_host: str | None = None,
    ) -> Cluster:
        """Start `num_engines` engines on `model_dir` (weights of `version`) and a router in
        front. Engine i runs in bundle `slots[i]` when given (anywhere otherwise); it binds that
        bundle's node IP with `bind_node_ips` (loopback otherwise) and pins the bundle's cores
        with `pin_slot_cores` (its share of `rollout_cores` otherwise).
        With `router_host` (this driver's node IP) the router runs on the driver's node and
        binds it. Nothing is left running if any part fails."""
        if slots is not None and len(slots) != num_engines:
            raise ValueError(f"{len(slots)} engine slots for {num_engines} engines")
        per = (
            [s.cores for s in slots]
            if slots and pin_slot_cores
            else _split(rollout_cores, num_engines)
        )
        launches = [
            _launch(
                i,
                model_dir=model_dir,
                version=version,
                seed=seed + 1000 * i,
                cores=per[i],
                slot=None if slots is None else slots[i],
                bind=bind_node_ips,
            )
            for i in range(num_engines)
        ]
        results = await asyncio.gather(
            *(backend.start(x) for x in launches), return_exceptions=True
        )
        engines = [r for r in results if isinstance(r, EngineHandle)]
        errors = [r for r in results if isinstance(r, BaseException)]
        router = None
        try:
            if errors:
                raise errors[0]
            rcfg = dataclasses.replace(router_cfg, worker_urls=tuple(h.url for h in engines))
            actor = RouterActor
            if router_host is not None:  # explicitly the driver's node, bound to its IP
                rcfg = dataclasses.replace(rcfg, host=router_host)
                here = ray.get_runtime_context().get_node_id()
                actor = RouterActor.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)
                )
            router = actor.remote(rcfg)
            router_url = await router.start.remote()
        except BaseException:
            await asyncio.gather(*(backend.stop(h) for h in engines), return_exceptions=True)
            if router is not None:
                with contextlib.suppress(Exception):
                    ray.kill(router)
            raise
        log.info("engines %s behind router %s", [h.identity for h in engines], router_url)
        return cls(
            backend=backend,
            engines=engines,
            router=router,
            router_url=router_url,
            control=RouterClient(router_url, token=rcfg.admin_api_key or rcfg.api_key),
            engine_cores=per,
            seed=seed,
            slots=slots,
            bind_node_ips=bind_node_ips,
        )

    async def engine_alive(self, i: int) -> bool:
        """Whether engine `i` still exists as far as its backend can tell."""
        return await self.backend.alive(self.engines[i])

    async def lost_node(self, i: int) -> str | None:
        """The IP of engine `i`'s node when Ray counts that node as dead; None when it is alive
        (or the engines run on the local node, unplaced)."""
        if self.slots is None:
            return None
        slot = self.slots[i]
        return None if await asyncio.to_thread(node_alive, slot.node_id) else slot.node_ip

    async def relocate(self, i: int, *, timeout_s: float) -> Slot | None:
        """Move engine `i`'s slot to where Ray re-placed its bundle after its node was lost
        (`placement.relocated`); None (the slot unchanged) when no live node had room within
        `timeout_s`. The next `replace_engine(i)` then starts there."""
        assert self.slots is not None
        slot = await asyncio.to_thread(relocated, self.slots[i], timeout_s=timeout_s)
        if slot is not None:
            self.slots[i] = slot
            self.engine_cores[i] = ()
        return slot

    async def drop_engine(self, i: int) -> str:
        """Take engine `i` out of the fleet for good (its node is lost and no live node has
        room): the router forgets it, its handle is stopped (bounded), the run goes on with the
        others. Returns its url."""
        h = self.engines.pop(i)
        self.engine_cores.pop(i)
        if self.slots is not None:
            self.slots.pop(i)
        self.pending.discard(h.url)
        with contextlib.suppress(Exception):
            await self.control.remove_worker(h.url)
        with contextlib.suppress(Exception):
            await self.backend.stop(h, timeout_s=REPLACE_STOP_TIMEOUT_S)
        return h.url

    async def replace_engine(
        self, i: int, *, model_dir: Path, version: int, admit: bool = True
    ) -> str:
        """Stop engine `i` and start a new one on `model_dir` (serving `version`); the router
        learns about it only once it is up (weight calls it missed replayed), then forgets the
        old one. With `admit` False (`version` is older than the fleet's and no router call can
        bring it up to date: the distributed transport) the router forgets the old one and the
        new one waits in `pending` for a push. Returns the new url. Raises for a backend that
        cannot restart engines."""
        if not self.backend.can_restart:
            raise RuntimeError(
                f"engine backend {type(self.backend).__name__} cannot restart engines"
            )
        old = self.engines[i]
        await self.backend.stop(old, timeout_s=REPLACE_STOP_TIMEOUT_S)
        launch = _launch(
            i,
            model_dir=model_dir,
            version=version,
            seed=self.seed + 1000 * i + 7 * (version + 1),
            cores=self.engine_cores[i],
            slot=None if self.slots is None else self.slots[i],
            bind=self.bind_node_ips,
        )
        new = await self.backend.start(launch)
        if not admit:
            with contextlib.suppress(KeyError):
                await self.control.remove_worker(old.url)
            self.pending.discard(old.url)
            self.engines[i] = new
            self.pending.add(new.url)
            return new.url
        try:
            await self.control.add_worker(new.url, wait_healthy_s=60.0)
        except BaseException:  # never leave a half-registered replacement behind
            with contextlib.suppress(Exception):
                await self.control.remove_worker(new.url)
            await self.backend.stop(new, timeout_s=REPLACE_STOP_TIMEOUT_S)
            raise
        with contextlib.suppress(KeyError):
            await self.control.remove_worker(old.url)
        self.engines[i] = new
        return new.url

    async def admit_caught_up(self, version: int, *, token: str | None) -> list[str]:
        """Register with the router every pending replacement that now serves `version` (a push
        reached it); returns their urls. The others stay pending."""
        self.pending &= set(self.engine_urls)  # a pending engine replaced again is gone
        urls = sorted(self.pending)
        if not urls:
            return []
        served = await self.served_versions(token=token, urls=urls)
        admitted = []
        for url, v in zip(urls, served, strict=True):
            if v is None or str(v) != str(version):
                continue
            try:
                await self.control.add_worker(url, wait_healthy_s=60.0)
            except Exception as e:  # stays pending: the next push tries again
                log.warning("replacement %s has v%d but was not admitted: %s", url, version, e)
                with contextlib.suppress(Exception):
                    await self.control.remove_worker(url)
                continue
            self.pending.discard(url)
            admitted.append(url)
        return admitted

    async def served_versions(
        self, *, token: str | None, timeout_s: float = 10.0, urls: list[str] | None = None
    ) -> list[Any]:
        """`weight_version` each engine (or each of `urls`) reports on `/model_info` (None
        where it did not answer)."""
        import aiohttp

        headers = {"Authorization": f"Bearer {token}"} if token else {}

        async def one(s: aiohttp.ClientSession, url: str) -> Any:
            try:
                async with s.get(f"{url}/model_info", headers=headers) as r:
                    return (await r.json()).get("weight_version") if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ValueError):
                return None

        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            targets = self.engine_urls if urls is None else urls
            return list(await asyncio.gather(*(one(s, u) for u in targets)))

    async def stop(self) -> None:
        """Stop the router and every engine the backend owns (bounded; never hangs)."""
        await self.control.close()
        try:
            await asyncio.wait_for(self.router.stop.remote(), 30)
        except Exception as e:  # shutting down: report, never hang
            log.warning("router did not stop cleanly: %s", e)
        await asyncio.gather(*(self.backend.stop(h) for h in self.engines), return_exceptions=True)
        with contextlib.suppress(Exception):
            ray.kill(self.router)


def _launch(
    i: int,
    *,
    model_dir: str | Path,
    version: int,
    seed: int,
    cores: tuple[int, ...],
    slot: Slot | None,
    bind: bool,
) -> EngineLaunch:
    """Engine i's launch, in its reserved bundle (if any), bound to that node's IP if `bind`."""
    return EngineLaunch(
        index=i,
        model_dir=str(model_dir),
        weight_version=version,
        seed=seed,
        cores=cores,
        host=slot.node_ip if slot is not None and bind else None,
        placement=None if slot is None else slot.actor_options(),
    )


def _split(cores: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """Give each of n engines a disjoint share of `cores` (all of them share when too few)."""
    if not cores:
        return [()] * n
    if len(cores) < n:
        return [cores] * n
    k = len(cores) // n
    return [cores[i * k : (i + 1) * k] for i in range(n)]
