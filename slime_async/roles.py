"""Ray roles of a run: the router actor, core pinning, and the handle set the controller holds.

Owns `RouterActor`, `init_ray`, `pin_actor` and `Cluster` (the run's engines as backend handles,
the router URL + client). Engines are started, checked, replaced and stopped only through the
engine backend protocol (`slime_async.contracts.engine`); which backend runs them (embedded Ray
actors, SGLang servers, attached external servers, a plugin) is chosen by the caller from the
registry in `slime_async.engine.backends`. Every actor is created with `num_cpus=0`: on a
2-core node three `num_cpus=1` actors never schedule and `ray.get` hangs silently
(cpu-stack.md §4). Cores are given out explicitly instead (`pin_cores` inside the process): the
CPU analogue of separate rollout and training GPU pools.
Never imports the controller, the supervisor or a backend implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from pathlib import Path

import ray

from router.client import RouterClient
from router.config import RouterConfig
from slime_async.contracts.engine import EngineBackend, EngineHandle, EngineLaunch
from slime_async.host import pin_cores

log = logging.getLogger(__name__)

REPLACE_STOP_TIMEOUT_S = 5.0
"""A replaced engine (dead or wedged) gets this long to stop before it is killed."""


def _pin_actor(_actor: object, cores: tuple[int, ...]) -> int:
    pin_cores(cores)
    return os.getpid()


async def pin_actor(actor: ray.actor.ActorHandle, cores: tuple[int, ...]) -> int:
    """Pin a running actor's process to `cores` (works for any actor class); returns its pid."""
    return await actor.__ray_call__.remote(_pin_actor, cores)


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


def init_ray(*, num_cpus: int | None = None) -> None:
    """Start a local Ray node quietly (no dashboard); a no-op when Ray is already up."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=num_cpus or max(2, os.cpu_count() or 2),
        include_dashboard=False,
        log_to_driver=True,
        logging_level=logging.WARNING,
        configure_logging=False,
    )


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

    @property
    def engine_urls(self) -> list[str]:
        return [h.url for h in self.engines]

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
    ) -> Cluster:
        """Start `num_engines` engines on `model_dir` (weights of `version`; cores split between
        them) and a router in front. Nothing is left running if any part fails."""
        per = _split(rollout_cores, num_engines)
        launches = [
            EngineLaunch(index=i, model_dir=str(model_dir), weight_version=version,
                         seed=seed + 1000 * i, cores=per[i])
            for i in range(num_engines)
        ]  # fmt: skip
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
            router = RouterActor.remote(rcfg)
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
            control=RouterClient(router_url, token=rcfg.auth_token),
            engine_cores=per,
            seed=seed,
        )

    async def engine_alive(self, i: int) -> bool:
        """Whether engine `i` still exists as far as its backend can tell."""
        return await self.backend.alive(self.engines[i])

    async def replace_engine(self, i: int, *, model_dir: Path, version: int) -> str:
        """Stop engine `i` and start a new one on `model_dir` (serving `version`); the router
        learns about it only once it is up (weight calls it missed replayed), then forgets the
        old one. Returns the new url. Raises for a backend that cannot restart engines."""
        if not self.backend.can_restart:
            raise RuntimeError(
                f"engine backend {type(self.backend).__name__} cannot restart engines"
            )
        old = self.engines[i]
        await self.backend.stop(old, timeout_s=REPLACE_STOP_TIMEOUT_S)
        launch = EngineLaunch(index=i, model_dir=str(model_dir), weight_version=version,
                              seed=self.seed + 1000 * i + 7 * (version + 1),
                              cores=self.engine_cores[i])  # fmt: skip
        new = await self.backend.start(launch)
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


def _split(cores: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """Give each of n engines a disjoint share of `cores` (all of them share when too few)."""
    if not cores:
        return [()] * n
    if len(cores) < n:
        return [cores] * n
    k = len(cores) // n
    return [cores[i * k : (i + 1) * k] for i in range(n)]
