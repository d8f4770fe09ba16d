"""The `embedded` engine backend: our engine (`EngineServer`) inside a Ray actor, on any device.

Owns `EngineActor` and `EmbeddedBackend`. The actor pins itself to its launch's cores before the
model loads; its pid is the engine's pid (the server is a thread of the actor process).
"""

from __future__ import annotations

import os
from typing import ClassVar

import ray

from slime_async.config.engine_backends import BUILTIN_NEEDS
from slime_async.config.engine_fleet import launch_engine_config
from slime_async.contracts.engine import EngineLaunch, EngineNeeds
from slime_async.engine.config import EngineConfig
from slime_async.host import gloo_interface, limit_kernel_caches, limit_malloc_arenas, pin_cores
from slime_async.orchestrator.engines.ray_actor import RayActorBackend


@ray.remote(num_cpus=0)
class EngineActor:
    """An embedded engine served from inside a Ray actor (its own thread + event loop)."""

    def __init__(self, cfg: EngineConfig, cores: tuple[int, ...] = ()) -> None:
        limit_malloc_arenas()  # the server's and torch's threads share two heaps
        limit_kernel_caches()
        pin_cores(cores)
        gloo_interface(cfg.host)  # a weight-update group reaches peers from the bound address
        from slime_async.engine import EngineServer

        self._server = EngineServer(cfg)

    def start(self) -> str:
        return self._server.start()

    def stop(self) -> None:
        self._server.stop()

    def pid(self) -> int:
        return os.getpid()

    def alive(self) -> bool:
        return True  # answering at all means the process lives


class EmbeddedBackend(RayActorBackend):
    """One `EngineActor` per engine; restartable; CPU or any device torch has."""

    needs: ClassVar[EngineNeeds] = BUILTIN_NEEDS["embedded"]
    label: ClassVar[str] = "embedded engine"

    def make_actor(self, launch: EngineLaunch) -> ray.actor.ActorHandle:
        actor = EngineActor.options(**launch.placement) if launch.placement else EngineActor
        return actor.remote(launch_engine_config(self.engine, launch), launch.cores)
