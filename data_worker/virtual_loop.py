"""An asyncio event loop that runs on a virtual clock.

Owns `VirtualTimeLoop` and `run_virtual`: when no callback is ready, the loop jumps its clock
straight to the next timer instead of sleeping, so `asyncio.sleep(3600)` costs no wall time.
The RolloutDataWorker reads time only through `loop.time()`, so the simulator
(`scripts/simulate_dispatch.py`) and the tests run the real worker code in simulated time,
deterministically. Real I/O still works (it is polled without blocking). If nothing is
scheduled and nothing is ready, the program can never make progress: the loop raises
`VirtualDeadlock` instead of hanging. Never imports `slime_async`.

Example:
    >>> async def nap():
    ...     await asyncio.sleep(3600.0)
    ...     return asyncio.get_running_loop().time()
    >>> run_virtual(nap())
    3600.0
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualDeadlock(RuntimeError):
    """Every task waits and no timer is scheduled: the simulated program is stuck."""


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            raise VirtualDeadlock(
                "virtual-time loop: every task is waiting and no timer is scheduled."
            )
        if timeout > 0:
            self.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """Selector event loop whose `time()` is virtual and advances only between timers."""

    def __init__(self) -> None:
        self._vsel = _VirtualSelector()
        super().__init__(self._vsel)

    def time(self) -> float:
        return self._vsel.now


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on a fresh `VirtualTimeLoop`, cancel leftovers, close it."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in left:
                t.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
