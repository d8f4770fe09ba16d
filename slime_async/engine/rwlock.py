"""SGLang's model-update lock: many readers (running `/generate` calls) or one writer (a weight
update that was not preceded by a pause), writer-preferring.

Owns: `RWLock`. A writer that is waiting blocks new readers, so an unpaused update waits for the
requests already running to finish ("drain, then swap") and is not starved by new ones; the new
ones start after it. Worked example: A and B generate (2 readers); an update arrives and waits;
C arrives and waits behind the update; A and B finish -> the update runs -> C starts.
Must never import torch, aiohttp or the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class RWLock:
    """asyncio reader/writer lock with writer preference (the loop that serves requests)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        """Readers holding the lock now."""
        self.writer_active = False
        self.writers_waiting = 0

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer_active and not self.writers_waiting)
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self.writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self.writer_active and self.readers == 0)
            finally:
                self.writers_waiting -= 1
                self._cond.notify_all()  # a cancelled writer must not keep readers out
            self.writer_active = True
        try:
            yield
        finally:
            async with self._cond:
                self.writer_active = False
                self._cond.notify_all()
