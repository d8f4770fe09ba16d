"""Control fan-out: send one control call to every engine and report each engine's outcome.

Owns: `ControlFanout` (the `/pause_generation`, `/continue_generation`,
`/update_weights_from_disk`, `/update_weight_version`, `/flush_cache`, `/abort_request`,
`/load_lora_adapter`, `/unload_lora_adapter` routes),
the reply shape (router/README.md, "Control fan-out reply"), and the log of weight-changing calls replayed on
an engine that is re-admitted after missing them.
Must never import: `slime_async`, or the proxy/health/server modules.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from router.config import RouterConfig
from router.pause import AbortPause, pause_mode
from router.workers import Worker, WorkerRegistry, WorkerState

CONTROL_PATHS: tuple[str, ...] = (
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/flush_cache",
    "/abort_request",
    "/load_lora_adapter",
    "/unload_lora_adapter",
)
WEIGHT_PATHS: frozenset[str] = frozenset(
    {"/update_weights_from_disk", "/update_weight_version", "/load_lora_adapter"}
)
_REQUIRED_KEYS = {
    "/update_weights_from_disk": "model_path",
    "/load_lora_adapter": "lora_path",
    "/unload_lora_adapter": "lora_name",
    "/update_weight_version": "new_version",
}
_ABORT_ALL = json.dumps({"abort_all": True}).encode()


def _engine_ok(status: int, body: object) -> bool:
    """An engine call succeeded: 2xx, and not an explicit `{"success": false}`."""
    if not 200 <= status < 300:
        return False
    return not (isinstance(body, dict) and body.get("success") is False)


def _reachable(status: int | None) -> bool:
    """The engine answered the call itself (no transport failure, no 5xx)."""
    return status is not None and status < 500


def _decode(data: bytes) -> object:
    if not data:
        return None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return data.decode("utf-8", "replace")[:2000]


class ControlFanout:
    """Fans control calls out to all registered engines concurrently."""

    def __init__(
        self,
        *,
        cfg: RouterConfig,
        registry: WorkerRegistry,
        session: Callable[[], aiohttp.ClientSession],
        pause: AbortPause | None = None,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self._session = session
        self.pause = pause if pause is not None else AbortPause()
        """The abort-mode pause the proxy honours (router/pause.py)."""
        self._timeout = aiohttp.ClientTimeout(
            total=cfg.control_timeout_s, sock_connect=cfg.connect_timeout_s
        )
        key = cfg.admin_api_key or cfg.api_key
        self._auth = {"Authorization": f"Bearer {key}"} if key else {}
        """What a control call presents to an engine: the admin key (SGLang's admin routes)."""
        self._weight_log: dict[str, tuple[int, str, str, bytes]] = {}
        """path -> (generation, method, path_qs, body) of the last successful weight call."""
        self.pauses = 0
        """`/pause_generation` fan-outs so far (part of the prefix-cache salt)."""
        self.fanouts = 0
        self.fanout_failures = 0

    async def handle(self, request: web.Request) -> web.Response:
        """HTTP entry: validate the body, fan out, reply 200 (all ok) or 207 (some failed)."""
        body = await request.read()
        path = request.path
        try:
            self._validate(path, body)
        except ValueError as e:
            return web.json_response(
                {"error": {"message": str(e), "type": "invalid_request_error", "code": 400}},
                status=400,
            )
        reply = await self.fan_out(request.method, path, request.path_qs, body)
        if reply["total"] == 0:
            return web.json_response(reply, status=503)
        return web.json_response(reply, status=200 if not reply["failed"] else 207)

    @staticmethod
    def _validate(path: str, body: bytes) -> None:
        if not body:
            if path in _REQUIRED_KEYS:
                raise ValueError(f"{path} needs a JSON body with '{_REQUIRED_KEYS[path]}'")
            return
        try:
            obj = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} body is not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError(f"{path} body nests JSON too deeply; send a flat object") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path} body must be a JSON object")
        key = _REQUIRED_KEYS.get(path)
        if path == "/load_lora_adapter" and obj.get("from_distributed") is True:
            key = "weight_version"  # the adapter received over a weight group (docs/lora.md)
        if key is not None and key not in obj:
            raise ValueError(f"{path} body needs '{key}'")

    async def fan_out(self, method: str, path: str, path_qs: str, body: bytes) -> dict:
        """Call `path_qs` on every registered engine; return the fan-out reply dict.

        Quarantines engines that failed at the transport level or with a 5xx. A weight call
        becomes the fleet's weights (logged, replayed on engines that missed it) when some
        engine took it, or when no engine could be reached at all (every engine down: those that
        come back must load it, not older weights); engines that refused it while it became the
        fleet's weights are quarantined too (they would serve stale weights). If every reachable
        engine refused, nothing changed and none is quarantined for it.
        """
        # a sleeping engine gets no control call: it catches up on the weight calls it missed
        # when it wakes (router/sleep.py), so only the engines that serve get a new version
        workers = [
            w
            for w in self.registry.all()
            if w.state not in (WorkerState.REMOVED, WorkerState.SLEEPING)
        ]
        self.fanouts += 1
        aborting = path == "/pause_generation" and pause_mode(body) == "abort"
        if path == "/pause_generation":  # before any engine pauses (router/cache_salt.py)
            self.pauses += 1
            if aborting:  # before any engine pauses: nothing is forwarded from here on
                self.pause.begin()
        elif path == "/continue_generation":
            self.pause.end()
        outcomes = await asyncio.gather(*(self._call(w, method, path_qs, body) for w in workers))
        if aborting:  # only an engine that paused holds what reaches it late
            await self._abort_held([w for w, o in zip(workers, outcomes) if o["success"]])
        results: dict[str, dict] = {}
        failed: list[dict] = []
        any_ok = any(o["success"] for o in outcomes)
        refused = any(not o["success"] and _reachable(o["status"]) for o in outcomes)
        applies = path in WEIGHT_PATHS and bool(workers) and (any_ok or not refused)
        if applies:
            self.registry.weight_generation += 1
            gen = self.registry.weight_generation
            self._weight_log[path] = (gen, method, path_qs, body)
        for w, o in zip(workers, outcomes):
            results[w.id] = o
            if o["success"]:
                if applies:
                    w.weight_generation = self.registry.weight_generation
                continue
            transport = not _reachable(o["status"])
            out_of_sync = applies
            if transport or out_of_sync:
                why = f"{path} failed: {o['error']}"
                w.total_failures += 1
                self.registry.quarantine(w, why)
            failed.append(
                {
                    "worker_id": w.id,
                    "url": w.url,
                    "status": o["status"],
                    "error": o["error"],
                    "message": o["body"] if isinstance(o["body"], str) else json.dumps(o["body"]),
                    "quarantined": w.state is WorkerState.QUARANTINED,
                }
            )
        self.fanout_failures += len(failed)
        return {
            "path": path,
            "results": results,
            "failed": failed,
            "total": len(workers),
            "succeeded": len(workers) - len(failed),
        }

    async def _abort_held(self, workers: list[Worker]) -> None:
        """Abort again, until none is left, the requests forwarded before the pause began that
        reached their engine after it paused (held there, not aborted: router/pause.py)."""
        deadline = time.monotonic() + self.cfg.control_timeout_s
        while self.pause.active and time.monotonic() < deadline:
            held = [
                w
                for w in workers
                if w.outstanding_requests
                and w.state not in (WorkerState.REMOVED, WorkerState.SLEEPING)
            ]
            if not held:
                return
            await asyncio.gather(
                *(self._call(w, "POST", "/abort_request", _ABORT_ALL) for w in held)
            )
            await asyncio.sleep(0.02)

    async def call(self, w: Worker, method: str, path_qs: str, body: bytes) -> dict:
        """One control call on one engine (the fan-out's per-engine outcome dict)."""
        return await self._call(w, method, path_qs, body)

    async def _call(self, w: Worker, method: str, path_qs: str, body: bytes) -> dict:
        t0 = time.perf_counter()
        headers = {**self._auth, **({"Content-Type": "application/json"} if body else {})}
        try:
            async with self._session().request(
                method, w.url + path_qs, data=body or None, headers=headers, timeout=self._timeout
            ) as r:
                data = _decode(await r.read())
                ok = _engine_ok(r.status, data)
                return {
                    "url": w.url,
                    "status": r.status,
                    "success": ok,
                    "latency_ms": round((time.perf_counter() - t0) * 1e3, 3),
                    "body": data,
                    "error": "" if ok else f"HTTP {r.status}",
                }
        except (aiohttp.ClientError, TimeoutError, asyncio.TimeoutError, ConnectionError) as e:
            return {
                "url": w.url,
                "status": None,
                "success": False,
                "latency_ms": round((time.perf_counter() - t0) * 1e3, 3),
                "body": None,
                "error": f"{type(e).__name__}: {e}",
            }

    async def catch_up(self, w: Worker, *, replay_all: bool = False) -> bool:
        """Replay the weight calls `w` missed (in order; `replay_all`: every logged one, for an
        engine that may have restarted and lost them); True if it is now in sync."""
        missed = sorted(
            e for e in self._weight_log.values() if replay_all or e[0] > w.weight_generation
        )
        for _gen, method, path_qs, body in missed:
            o = await self._call(w, method, path_qs, body)
            if not o["success"]:
                w.last_error = f"catch-up {path_qs} failed: {o['error']}"
                return False
        w.weight_generation = self.registry.weight_generation
        return True
