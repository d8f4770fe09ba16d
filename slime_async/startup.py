"""What a run says while it starts: one `start-up:` log line per phase, and a line every
`WAIT_EVERY_S` while it waits on something slow (an engine loading, an SGLang server's /health).

Owns the start-up clock: it starts at the first line (a GGUF conversion at parse time, else the
Ray line of `launch.setup_run`) and stops at `done` (or `abandon`, after a failed start), so
every line carries the seconds since start-up began. Imports nothing from slime_async.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

log = logging.getLogger("slime_async.startup")

WAIT_EVERY_S = 12.0
"""Seconds between two `waiting for ...` lines."""

T = TypeVar("T")
_t0: list[float] = []


def elapsed() -> float:
    """Seconds since start-up began (0 before its first line)."""
    return time.monotonic() - _t0[0] if _t0 else 0.0


def say(what: str) -> None:
    """One phase line: `start-up: <what> [<seconds since start-up began> s]`."""
    if not _t0:
        _t0.append(time.monotonic())
    log.info("start-up: %s [%.0f s]", what, elapsed())


def done(what: str = "training") -> None:
    """The last line, `start-up: done in N s; training`; the next run's start-up starts anew."""
    log.info("start-up: done in %.0f s; %s", elapsed(), what)
    _t0.clear()


def abandon() -> None:
    """A start-up that failed: forget its clock (a retry in this process starts anew)."""
    _t0.clear()


async def waiting(aw: Awaitable[T], what: str, *, limit_s: float | None = None) -> T:
    """Await `aw`, saying `start-up: waiting for <what> (12 s of 900 s)` every `WAIT_EVERY_S`
    until it finishes (`limit_s`: the bound the awaited thing enforces itself, only shown)."""
    task = asyncio.ensure_future(aw)
    t0 = time.monotonic()
    try:
        while True:
            finished, _ = await asyncio.wait({task}, timeout=WAIT_EVERY_S)
            if finished:
                return task.result()
            waited = time.monotonic() - t0
            bound = f" of {limit_s:.0f} s" if limit_s is not None else ""
            log.info("start-up: waiting for %s (%.0f s%s)", what, waited, bound)
    finally:
        if not task.done():
            task.cancel()
