"""Sleep and wake of engines through the router: abort, drain, sleep; wake, catch up, admit.

Owns: `SleepControl` (the router's `/release_memory_occupation` and
`/resume_memory_occupation` routes) and `parse_sleep_body`. The body is SGLang's (`tags`, null:
all) plus our `worker_urls` (which engines; absent: every engine that serves). A release takes
each engine out of rotation first (`WorkerState.SLEEPING`: no new request is bound to it, no
probe re-admits it, no control fan-out reaches it), aborts what runs on it
(`/abort_request {"abort_all": true}`) until none of its requests is in flight (the proxy
re-dispatches each aborted one to another engine: router/proxy.py), then calls the engine's
release. With `drain_s` in the body (ours, not SGLang's) the release first waits up to that
many seconds for the engine's running requests to finish on their own (a drain: out of
rotation, nothing cut) and aborts only what is left. An engine that refuses (it was not idle yet) is retried until `control_timeout_s`,
then put back into rotation and reported failed. A resume wakes the engine, replays the weight
calls it missed while asleep (the control fan-out skips sleeping engines: only engines that
serve get a new version), and only then admits it. Reply: the control fan-out's shape.
Must never import: `slime_async`, or the proxy/health/server modules.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from router.control import ControlFanout
from router.workers import Worker, WorkerRegistry, WorkerState

_ABORT_ALL = json.dumps({"abort_all": True}).encode()
SLEEP_PATHS = ("/release_memory_occupation", "/resume_memory_occupation")


def parse_drain_s(raw: bytes) -> float:
    """The body's `drain_s` (0 when absent); ValueError when it is not a number >= 0."""
    body = json.loads(raw) if raw.strip() else {}
    v = body.get("drain_s", 0.0) if isinstance(body, dict) else 0.0
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < float("inf"):
        raise ValueError(f"drain_s must be a number of seconds >= 0, got {v!r}")
    return float(v)


def parse_sleep_body(raw: bytes) -> tuple[Any, tuple[str, ...] | None]:
    """`(tags as sent, worker_urls or None)`; ValueError names a bad field."""
    if not raw.strip():
        return None, None
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object: {tags, worker_urls}")
    tags, urls = body.get("tags"), body.get("worker_urls")
    if tags is not None and (
        not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)
    ):
        raise ValueError("tags must be a list of strings (SGLang's memory tags) or null")
    if urls is not None and (
        not isinstance(urls, list) or not all(isinstance(u, str) for u in urls)
    ):
        raise ValueError("worker_urls must be a list of engine URLs (as in GET /workers)")
    return tags, None if urls is None else tuple(urls)


class SleepControl:
    """The router's sleep and wake routes (one per router)."""

    def __init__(self, *, registry: WorkerRegistry, control: ControlFanout) -> None:
        self.registry = registry
        self.control = control
        self.sleeps = 0
        self.wakes = 0

    def _targets(self, urls: tuple[str, ...] | None, *, waking: bool) -> list[Worker]:
        if urls is None:
            want = WorkerState.SLEEPING if waking else WorkerState.HEALTHY
            return [w for w in self.registry.all() if w.state is want]
        out = []
        for url in urls:
            w = self.registry.find_url(url.rstrip("/"))
            if w is None:
                raise ValueError(f"worker_urls: {url} is not registered (see GET /workers)")
            out.append(w)
        return out

    async def handle(self, request: web.Request) -> web.Response:
        waking = request.path == "/resume_memory_occupation"
        try:
            raw = await request.read()
            tags, urls = parse_sleep_body(raw)
            drain_s = parse_drain_s(raw)
            targets = self._targets(urls, waking=waking)
        except ValueError as e:
            return web.json_response(
                {"error": {"message": str(e), "type": "invalid_request_error", "code": 400}},
                status=400,
            )
        body = json.dumps({"tags": tags}).encode()
        if waking:
            outcomes = await asyncio.gather(*(self.wake(w, body, tags) for w in targets))
        else:
            outcomes = await asyncio.gather(*(self.sleep(w, body, tags, drain_s) for w in targets))
        failed = [
            {"worker_id": w.id, "url": w.url, "status": o["status"], "error": o["error"]}
            for w, o in zip(targets, outcomes)
            if not o["success"]
        ]
        reply = {
            "path": request.path,
            "results": {w.id: o for w, o in zip(targets, outcomes)},
            "failed": failed,
            "total": len(targets),
            "succeeded": len(targets) - len(failed),
        }
        return web.json_response(reply, status=200 if not failed else 207)

    async def sleep(self, w: Worker, body: bytes, tags: Any, drain_s: float = 0.0) -> dict:
        """(Wait up to `drain_s`) → abort → drain → release on one engine (module docstring)."""
        if w.state is WorkerState.SLEEPING:  # already asleep: release more tags
            return await self.control.call(w, "POST", "/release_memory_occupation", body)
        was = w.state
        self.registry.sleep(w)
        self.sleeps += 1
        drained = time.monotonic() + drain_s
        while w.outstanding_requests and time.monotonic() < drained:
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + self.control.cfg.control_timeout_s
        while True:
            while w.outstanding_requests and time.monotonic() < deadline:
                await self.control.call(w, "POST", "/abort_request", _ABORT_ALL)
                await asyncio.sleep(0.02)
            o = await self.control.call(w, "POST", "/release_memory_occupation", body)
            if o["success"]:
                w.sleep_tags = tuple(tags or ("weights", "kv_cache", "cuda_graph"))
                return o
            if o["status"] == 400 and time.monotonic() < deadline:  # not idle yet: again
                await asyncio.sleep(0.05)
                continue
            if was is WorkerState.HEALTHY:  # it never slept: back into rotation
                self.registry.admit(w)
            return o

    async def wake(self, w: Worker, body: bytes, _tags: Any) -> dict:
        """Resume, catch up on missed weight calls, admit."""
        o = await self.control.call(w, "POST", "/resume_memory_occupation", body)
        if not o["success"]:
            return o
        self.wakes += 1
        w.sleep_tags = ()
        if w.weight_generation < self.registry.weight_generation and not (
            await self.control.catch_up(w)
        ):
            w.state = WorkerState.PENDING  # out of SLEEPING: the health checker retries
            self.registry.quarantine(w, f"catch-up after wake failed: {w.last_error}")
            return {**o, "success": False, "error": f"woke, but {w.last_error}"}
        self.registry.admit(w)
        return o
