"""Ray roles of a run: engine actors, the router actor, and their start/stop.

Owns `EngineActor`, `RouterActor`, `pin_cores` and `Cluster` (the handles the controller
holds: engine actors, router URL + client, trainer actor). Every actor is created with
`num_cpus=0`: on a 2-core node three `num_cpus=1` actors never schedule and `ray.get` hangs
silently (cpu-stack.md §4). Cores are given out explicitly instead, by `os.sched_setaffinity`
inside the actor: the CPU analogue of separate rollout and training GPU pools.
Never imports the controller.
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
from slime_async.engine.config import EngineConfig

log = logging.getLogger(__name__)


def pin_cores(cores: tuple[int, ...]) -> None:
    """Restrict every thread of this process (and threads started later) to `cores`, and size
    torch's intra-op pool to match."""
    if not cores:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except (ProcessLookupError, PermissionError):  # thread exited meanwhile
            continue
    import torch

    torch.set_num_threads(len(cores))


def _pin_actor(_actor: object, cores: tuple[int, ...]) -> int:
    pin_cores(cores)
    return os.getpid()


async def pin_actor(actor: ray.actor.ActorHandle, cores: tuple[int, ...]) -> int:
    """Pin a running actor's process to `cores` (works for any actor class); returns its pid."""
    return await actor.__ray_call__.remote(_pin_actor, cores)


@ray.remote(num_cpus=0)
class EngineActor:
    """An embedded engine served from inside a Ray actor (its own thread + event loop)."""

    def __init__(self, cfg: EngineConfig, cores: tuple[int, ...] = ()) -> None:
        pin_cores(cores)
        from slime_async.engine import EngineServer

        self._server = EngineServer(cfg)

    def start(self) -> str:
        return self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class SGLangActor:
    """A real SGLang server (GPUs) launched and owned by a Ray actor; Ray's GPU assignment
    (`CUDA_VISIBLE_DEVICES`) gives each engine its own devices. Exercised only where GPUs exist."""

    def __init__(self, cfg: EngineConfig, cores: tuple[int, ...] = ()) -> None:
        del cores
        from slime_async.engine.sglang import SGLangConfig, SGLangServer
        from slime_async.trainer.parallel import free_port

        if cfg.model_dir is None:
            raise ValueError("the sglang backend serves an HF directory: model_dir is required")
        self._server = SGLangServer(
            SGLangConfig(
                model_path=cfg.model_dir,
                host=cfg.host,
                port=free_port(),
                random_seed=cfg.seed,
                weight_version=cfg.weight_version,
                max_running_requests=cfg.max_running_requests,
                context_length=cfg.context_length,
                enable_return_routed_experts=True,
                skip_tokenizer_init=True,
            )
        )

    def start(self) -> str:
        return self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def pid(self) -> int:
        return os.getpid()


def engine_actor(backend: str, cfg: EngineConfig, cores: tuple[int, ...]) -> ray.actor.ActorHandle:
    """Start one engine actor of `backend` ('embedded' on any device, 'sglang' on one GPU)."""
    if backend == "sglang":
        return SGLangActor.options(num_gpus=1).remote(cfg, cores)
    if backend != "embedded":
        raise ValueError(f"unknown engine backend {backend!r}; use 'embedded' or 'sglang'")
    return EngineActor.remote(cfg, cores)


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
    """Live handles of one run's roles."""

    engines: list[ray.actor.ActorHandle]
    engine_urls: list[str]
    router: ray.actor.ActorHandle
    router_url: str
    control: RouterClient
    engine_cfg: EngineConfig
    engine_cores: list[tuple[int, ...]]
    backend: str

    @classmethod
    async def start(
        cls,
        *,
        engine_cfg: EngineConfig,
        num_engines: int,
        router_cfg: RouterConfig,
        rollout_cores: tuple[int, ...],
        backend: str = "embedded",
    ) -> Cluster:
        """Start `num_engines` engines (cores split between them) and a router in front."""
        engines, per = [], _split(rollout_cores, num_engines)
        for i in range(num_engines):
            cfg = dataclasses.replace(engine_cfg, seed=engine_cfg.seed + 1000 * i)
            engines.append(engine_actor(backend, cfg, per[i]))
        urls = list(await asyncio.gather(*(e.start.remote() for e in engines)))
        rcfg = dataclasses.replace(router_cfg, worker_urls=tuple(urls))
        router = RouterActor.remote(rcfg)
        router_url = await router.start.remote()
        log.info("engines %s behind router %s", urls, router_url)
        return cls(
            engines=engines,
            engine_urls=urls,
            router=router,
            router_url=router_url,
            control=RouterClient(router_url, token=rcfg.auth_token),
            engine_cfg=engine_cfg,
            engine_cores=per,
            backend=backend,
        )

    async def replace_engine(self, i: int, *, model_dir: Path, version: int) -> str:
        """Kill engine `i` and start a new one on `model_dir` (serving `version`); the router
        learns about it only once it is up, then forgets the old one. Returns the new url."""
        old_url, old = self.engine_urls[i], self.engines[i]
        with contextlib.suppress(Exception):
            ray.kill(old)
        cfg = dataclasses.replace(
            self.engine_cfg,
            model_dir=str(model_dir),
            weight_version=str(version),
            seed=self.engine_cfg.seed + 1000 * i + 7 * (version + 1),
        )
        actor = engine_actor(self.backend, cfg, self.engine_cores[i])
        url = await actor.start.remote()
        await self.control.add_worker(url, wait_healthy_s=60.0)
        with contextlib.suppress(KeyError):
            await self.control.remove_worker(old_url)
        self.engines[i], self.engine_urls[i] = actor, url
        return url

    async def engine_pids(self) -> list[int]:
        return list(await asyncio.gather(*(e.pid.remote() for e in self.engines)))

    async def stop(self) -> None:
        await self.control.close()
        for call in (self.router.stop.remote(), *(e.stop.remote() for e in self.engines)):
            try:
                await asyncio.wait_for(call, 30)
            except Exception as e:  # shutting down: report, never hang
                log.warning("role did not stop cleanly: %s", e)
        for actor in (self.router, *self.engines):
            ray.kill(actor)


def _split(cores: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    """Give each of n engines a disjoint share of `cores` (all of them share when too few)."""
    if not cores:
        return [()] * n
    if len(cores) < n:
        return [cores] * n
    k = len(cores) // n
    return [cores[i * k : (i + 1) * k] for i in range(n)]
