"""Shared lifecycle of engine backends whose engine lives in a Ray actor.

Owns `RayActorBackend` (start an actor, wait for its URL, check it, stop it and then kill it). A
subclass names its needs and builds the actor; the actor exposes `start() -> url`, `stop()`,
`pid() -> int` (the process that serves) and `alive() -> bool`. Every actor is created with
`num_cpus=0`: on a 2-core node actors asking for a CPU each never schedule (docs/cpu.md).
Must never import roles, the controller or the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, ClassVar

import ray

from slime_async import startup
from slime_async.contracts.engine import EngineHandle, EngineLaunch, EngineNeeds
from slime_async.engine.config import EngineConfig

log = logging.getLogger(__name__)

ALIVE_TIMEOUT_S = 10.0
"""An actor that does not answer `alive()` this fast counts as wedged."""


class RayActorBackend:
    """Base of backends that serve each engine from one Ray actor (see module docstring)."""

    needs: ClassVar[EngineNeeds] = EngineNeeds()
    can_restart: ClassVar[bool] = True
    label: ClassVar[str] = "engine"
    """Word used in handle identities and logs."""

    def __init__(self, fleet: Any, engine: EngineConfig) -> None:
        self.fleet, self.engine = fleet, engine

    def make_actor(self, launch: EngineLaunch) -> ray.actor.ActorHandle:
        """Create (not yet start) the actor of `launch`."""
        raise NotImplementedError

    async def preflight(self) -> None:
        return None

    async def waits_for(self, actor: ray.actor.ActorHandle, launch: EngineLaunch) -> str:
        """What a start waits for, as the periodic `start-up: waiting for ...` lines say it."""
        return f"{self.label} {launch.index}"

    def start_limit_s(self) -> float | None:
        """The bound the actor's `start()` enforces itself, if any (only shown in those lines)."""
        return None

    async def start(self, launch: EngineLaunch) -> EngineHandle:
        actor = self.make_actor(launch)
        try:
            what = await self.waits_for(actor, launch)
            url = await startup.waiting(actor.start.remote(), what, limit_s=self.start_limit_s())
            pid = await actor.pid.remote()
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise
        return EngineHandle(
            index=launch.index, url=url, pid=pid, identity=f"{self.label} pid {pid}", ref=actor
        )

    async def alive(self, handle: EngineHandle) -> bool:
        try:
            return bool(await asyncio.wait_for(handle.ref.alive.remote(), ALIVE_TIMEOUT_S))
        except (ray.exceptions.RayError, TimeoutError):
            return False

    async def stop(self, handle: EngineHandle, *, timeout_s: float = 30.0) -> None:
        try:
            await asyncio.wait_for(handle.ref.stop.remote(), timeout_s)
        except ray.exceptions.RayActorError:
            pass  # already dead: nothing left to stop gracefully
        except Exception as e:  # wedged or failing: it is killed below either way
            log.warning(
                "%s %d (%s) did not stop cleanly: %r", self.label, handle.index, handle.url, e
            )
        with contextlib.suppress(Exception):
            ray.kill(handle.ref)
