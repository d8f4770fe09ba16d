"""SGLang's push sequence, shared by every weight transport: pause generation in place, run
the update (without a cache flush), continue — continue also when the update failed, so that
no engine is left paused. An engine that does not pause still takes the update, after its
running requests drained (SGLang's lock rule; docs/weight-sync.md)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from router.client import FanoutError, RouterClient

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def paused_in_place(control: RouterClient, version: int) -> AsyncIterator[None]:
    """Around the update of `version`: `/pause_generation {"mode": "in_place"}` before,
    `/continue_generation` after (fan-out failures are logged, never raised)."""
    try:
        await control.pause_generation(mode="in_place")
    except FanoutError as e:
        log.warning("pause before weight push v%d: %s", version, e)
    try:
        yield
    finally:
        try:
            await control.continue_generation()
        except FanoutError as e:
            log.warning("continue after weight push v%d: %s", version, e)
