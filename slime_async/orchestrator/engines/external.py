"""The `external` engine backend: attach SGLang-API servers that are already running, by URL.

Owns `ExternalBackend` and `EngineAttachError`. For clusters where SGLang (or our engine) is
launched separately: `--engine-backend external --engine-urls http://h1:30000,http://h2:30000`.
It never starts, restarts or stops a server:

* `preflight` (before the trainer starts) and `start` check that every URL answers `/health`
  with 200 and `/model_info` with a JSON object within `--engine-attach-timeout`; otherwise
  `EngineAttachError` names each URL and what it answered;
* the servers keep whatever weights they were launched with until the run pushes its current
  version to them, which it does before the first generate (`EngineNeeds.model_dir=False`), so
  trainer and engines begin identical;
* a dead server cannot be replaced (`can_restart=False`): the router re-admits it, with the
  weight calls it missed replayed, once it answers `/health` again; with none healthy for
  `--engine-down-timeout` the run stops with a checkpoint;
* at shutdown the servers are left running; `pid` is None (they are not ours to signal).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, ClassVar

import aiohttp

from slime_async.config.engine_backends import BUILTIN_NEEDS
from slime_async.contracts.engine import EngineHandle, EngineLaunch, EngineNeeds

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
"""Most seconds one `/health` or `/model_info` call may take."""


class EngineAttachError(RuntimeError):
    """An `--engine-urls` server did not answer as a running engine."""


async def _get(session: aiohttp.ClientSession, url: str, timeout: float) -> tuple[int, Any]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        body = await r.json(content_type=None) if r.status == 200 else await r.text()
        return r.status, body


def _auth(token: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {token}"} if token else None


async def probe(url: str, *, timeout_s: float, token: str | None = None) -> dict[str, Any]:
    """Poll `url` until `/health` is 200 and `/model_info` a JSON object (returned), or raise
    `EngineAttachError` after `timeout_s` with the last answer, or at once when the key is
    refused. `token`: the run's data-plane key (servers started with SGLang's `--api-key`
    require it on `/model_info`)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(headers=_auth(token)) as s:
        while True:
            left = deadline - time.monotonic()
            try:
                status, _ = await _get(s, f"{url}/health", min(PROBE_TIMEOUT_S, max(0.1, left)))
                if status != 200:
                    last = f"/health answered HTTP {status}"
                else:
                    status, info = await _get(s, f"{url}/model_info", PROBE_TIMEOUT_S)
                    if status == 200 and isinstance(info, dict):
                        return info
                    last = f"/model_info answered HTTP {status}: {str(info)[:200]}"
                    if status in (401, 403):  # a wrong key does not fix itself: say so now
                        raise EngineAttachError(
                            f"external engine {url} refused the run's data-plane key ({last}); "
                            "give the key it was started with (--api-key) as $SLIME_ASYNC_API_KEY "
                            "or --api-key-file"
                        )
            except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() + 0.2 >= deadline:
                raise EngineAttachError(
                    f"external engine {url} did not answer /health and /model_info within "
                    f"{timeout_s:g}s ({last}); start the server first, or fix --engine-urls "
                    "(or raise --engine-attach-timeout)"
                )
            await asyncio.sleep(0.2)


class ExternalBackend:
    """Engines are the servers at `fleet.urls`, one per index (see module docstring)."""

    needs: ClassVar[EngineNeeds] = BUILTIN_NEEDS["external"]
    can_restart: ClassVar[bool] = False

    def __init__(self, fleet: Any, engine: Any = None) -> None:
        # the servers were configured by whoever launched them; the run's data-plane key is what
        # the probes (/health, /model_info) present
        self.token: str | None = getattr(engine, "api_key", None)
        self.urls: tuple[str, ...] = tuple(fleet.urls)
        self.timeout_s: float = fleet.attach_timeout_s

    async def preflight(self) -> None:
        results = await asyncio.gather(
            *(probe(u, timeout_s=self.timeout_s, token=self.token) for u in self.urls),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise EngineAttachError("; ".join(str(e) for e in errors))

    async def start(self, launch: EngineLaunch) -> EngineHandle:
        url = self.urls[launch.index]
        info = await probe(url, timeout_s=self.timeout_s, token=self.token)
        log.info(
            "attached external engine %d at %s (model %s, serving weight version %s; the "
            "run's weights are pushed before the first generate)",
            launch.index,
            url,
            info.get("model_path"),
            info.get("weight_version"),
        )
        return EngineHandle(index=launch.index, url=url, pid=None, identity=f"external {url}")

    async def alive(self, handle: EngineHandle) -> bool:
        try:
            async with aiohttp.ClientSession(headers=_auth(self.token)) as s:
                status, _ = await _get(s, f"{handle.url}/health", PROBE_TIMEOUT_S)
            return status == 200
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ValueError):
            return False

    async def stop(self, handle: EngineHandle, *, timeout_s: float = 30.0) -> None:
        del timeout_s
        log.info("leaving external engine %d at %s running", handle.index, handle.url)
