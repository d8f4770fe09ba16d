"""Test-only engine backend: our embedded engine as a plain child process, without Ray.

Each engine is `python -m slime_async.engine ...` (`EngineProcess`), a launch path different
from the built-in `embedded` backend's Ray actor. It is added the way any backend is: this one
file, plus the one `register_engine_backend` line at the bottom. Select it with
`--engine-backend tests.plugins.subprocess_engine:subprocess` (the repository root is on sys.path under pytest).
Cores are not pinned (the engine's `num_threads` still bounds torch's pool).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from slime_async.contracts.engine import EngineHandle, EngineLaunch, EngineNeeds
from slime_async.engine import EngineConfig, EngineProcess
from slime_async.orchestrator.engines import launch_engine_config, register_engine_backend


class SubprocessBackend:
    """One `python -m slime_async.engine` child process per engine; restartable."""

    needs: ClassVar[EngineNeeds] = EngineNeeds(
        model_dir=True, versioned_adapters=True, distributed_adapters=True
    )
    can_restart: ClassVar[bool] = True

    def __init__(self, fleet: Any, engine: EngineConfig) -> None:
        self.engine = engine

    async def preflight(self) -> None:
        return None

    async def start(self, launch: EngineLaunch) -> EngineHandle:
        proc = EngineProcess(launch_engine_config(self.engine, launch))
        try:
            url = await asyncio.to_thread(proc.start)
        except BaseException:
            await asyncio.to_thread(proc.stop)
            raise
        assert proc.proc is not None
        pid = proc.proc.pid
        return EngineHandle(
            index=launch.index, url=url, pid=pid, identity=f"subprocess pid {pid}", ref=proc
        )

    async def alive(self, handle: EngineHandle) -> bool:
        return handle.ref.proc is not None and handle.ref.proc.poll() is None

    async def stop(self, handle: EngineHandle, *, timeout_s: float = 30.0) -> None:
        await asyncio.to_thread(handle.ref.stop, timeout_s)


register_engine_backend("subprocess", SubprocessBackend)
