"""A stop that stops: once a run knows why it must stop (a lost trainer rank, no engine left, a
node that cannot see a path), the process says so in one line and ends with status 3 within a
bound, whatever its other threads are blocked in.

Owns `StopWatchdog` and `STOP_BOUND_S`. Why a watchdog: a survivor of a lost peer can sit in a
collective that never returns (a trainer rank in gloo/NCCL, a Ray call on it, a weight
broadcast); the thread that waits for it cannot be cancelled, and both `asyncio.run` (which
joins its executor's threads) and the interpreter's exit (which joins every non-daemon thread)
would wait for it forever. `arm(reason)` prints `train_async: stopped: <reason>` once and starts
a daemon thread that ends the process with `os._exit(3)` after `bound_s`; teardown that
finishes in time ends it sooner through `exit()` (a bounded `ray.shutdown`, then `os._exit(3)`:
the Ray actors, the router and the engines go with the driver, or are abandoned to Ray, which
ends a job's actors when its driver is gone). `train_async.py` holds one; the step loop arms it
(`controller.train(on_stop=...)`) as soon as it knows the reason, before it tears anything down.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn, TextIO

STOP_BOUND_S = 120.0
"""How long tearing the run down may take once the reason is known (the weight transport's
bounded close, the router and engines, the trainer's actors, Ray) before the process is ended
regardless."""
STOP_STATUS = 3
"""The exit status of a run that stopped for a reason it printed."""
RAY_SHUTDOWN_S = 20.0
"""How long `exit()` lets `ray.shutdown()` take."""


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing more to say
            stream.flush()


class StopWatchdog:
    """The one-line reason and the bounded end of a stopping run (see the module docstring).

    Example::

        stop = StopWatchdog()
        try:
            asyncio.run(train(cfg, on_stop=stop.arm))
        except TrainerLostError as e:
            stop.arm(str(e))   # printed once, however many times it is armed
            stop.exit()        # status 3 now; or the watchdog's, bound_s after arm
    """

    def __init__(
        self,
        *,
        bound_s: float | None = None,
        out: TextIO | None = None,
        end: Callable[[int], NoReturn] = os._exit,
    ) -> None:
        self.bound_s = STOP_BOUND_S if bound_s is None else bound_s
        """Seconds from `arm` to the end of the process at the latest (`STOP_BOUND_S`)."""
        self._out = out
        self._end = end
        self._lock = threading.Lock()
        self.reason: str | None = None
        """Why the run stops (None: not armed)."""

    def arm(self, reason: str) -> None:
        """Say `reason` (once) and start the bound; later calls change nothing."""
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
        print(f"train_async: stopped: {reason}", file=self._out or sys.stderr, flush=True)
        threading.Thread(target=self._watch, name="stop-watchdog", daemon=True).start()

    def _watch(self) -> None:
        time.sleep(self.bound_s)
        print(
            f"train_async: teardown did not finish within {self.bound_s:g}s of the stop; "
            "ending the process (status 3)",
            file=self._out or sys.stderr,
            flush=True,
        )
        _flush()
        self._end(STOP_STATUS)

    def exit(self) -> NoReturn:
        """End the process now with status 3: Ray shut down (bounded), then `os._exit`, which
        joins no thread that may be stuck in a call that never returns."""
        done = threading.Event()

        def shutdown() -> None:
            try:
                import ray

                if ray.is_initialized():
                    ray.shutdown()
            except Exception:  # ending anyway: a failed shutdown changes nothing
                pass
            done.set()

        threading.Thread(target=shutdown, name="ray-shutdown", daemon=True).start()
        done.wait(min(RAY_SHUTDOWN_S, self.bound_s))
        _flush()
        self._end(STOP_STATUS)
