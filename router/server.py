"""The router service: aiohttp app assembly, auth, worker-registry routes, metrics, runners.

Owns: `Router` (async `start() -> url` / `stop()`), `RouterThread` (the same in a background
thread for synchronous callers), `build_app`. Who may call which route is `router.access` (its
middleware runs first on every request).
Must never import: `slime_async` (the router is a leaf package).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from router.access import auth_middleware
from router.affinity import GroupAffinity
from router.cache_salt import salt_value
from router.config import RouterConfig, check_worker_url, is_loopback, validate_config
from router.control import CONTROL_PATHS, ControlFanout
from router.dispatch import Dispatcher
from router.health import HealthMonitor
from router.metrics import metrics_json, metrics_prometheus
from router.pause import AbortPause
from router.policies import make_policy
from router.proxy import Proxy, error_response
from router.sleep import SLEEP_PATHS, SleepControl
from router.workers import WorkerRegistry, WorkerState

GENERATE_PATHS: tuple[str, ...] = ("/generate", "/v1/completions", "/v1/chat/completions")
INFO_PATHS: tuple[str, ...] = (
    "/get_model_info",
    "/model_info",
    "/get_server_info",
    "/server_info",
    "/v1/models",
    "/health_generate",
)
log = logging.getLogger(__name__)


class Router:
    """One router instance: registry + dispatcher (policy, late-binding queue) + health checker +
    proxy + control fan-out.

    Example:
        >>> r = Router(RouterConfig(worker_urls=("http://127.0.0.1:30001",)))
        >>> url = await r.start()          # doctest: +SKIP  (http://127.0.0.1:<port>)
        >>> await r.stop()                 # doctest: +SKIP
    """

    def __init__(self, cfg: RouterConfig) -> None:
        validate_config(cfg)
        self.cfg = cfg
        self.registry = WorkerRegistry(
            failure_threshold=cfg.failure_threshold, success_threshold=cfg.success_threshold
        )
        for url in cfg.worker_urls:
            self.registry.add(check_worker_url(url))
        self._session: aiohttp.ClientSession | None = None
        self.abort_pause = AbortPause()
        self.control = ControlFanout(
            cfg=cfg, registry=self.registry, session=self.session, pause=self.abort_pause
        )
        self.health = HealthMonitor(
            cfg=cfg, registry=self.registry, session=self.session, catch_up=self.control.catch_up
        )
        self.dispatcher = Dispatcher(
            registry=self.registry,
            policy=make_policy(cfg.policy),
            capacity_tokens=cfg.worker_capacity_tokens,
            wait_for_worker_s=cfg.wait_for_worker_s,
            affinity=GroupAffinity(slack_tokens=cfg.group_affinity_tokens),
        )
        self.proxy = Proxy(
            cfg=cfg,
            registry=self.registry,
            dispatcher=self.dispatcher,
            session=self.session,
            on_failure=self.health.poke,
            salt=self._salt if cfg.cache_salt else None,
            pause=self.abort_pause,
        )
        self.sleep = SleepControl(registry=self.registry, control=self.control)
        self._runner: web.AppRunner | None = None
        self._started = time.monotonic()
        self.url = ""

    def check_not_self(self, url: str) -> None:
        """Raise if `url` is this router's own listener (requests would loop through it)."""
        if not self.url:
            return
        own, got = urlsplit(self.url), urlsplit(url)
        if got.port != own.port:
            return
        host, bound = got.hostname or "", own.hostname or ""
        if bound in ("0.0.0.0", "::"):  # every interface of this machine
            mine = is_loopback(host) or host in (socket.gethostname(), socket.getfqdn())
        elif is_loopback(bound):
            mine = is_loopback(host)
        else:
            mine = host == bound
        if mine:
            raise ValueError(
                f"worker url {url} is this router itself ({self.url}): requests would loop; "
                "register the engines' own URLs"
            )

    def session(self) -> aiohttp.ClientSession:
        """The shared client session to engines (exists between start and stop)."""
        if self._session is None:
            raise RuntimeError("router is not started: call `await router.start()` first")
        return self._session

    def _salt(self) -> str:
        return salt_value(self.control.pauses, self.registry.weight_generation)

    async def start(self) -> str:
        """Bind, start health checks, and return the base url (`http://host:port`)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.cfg.max_connections, force_close=False),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            cookie_jar=aiohttp.DummyCookieJar(),
            # the data-plane key on every call; control calls present the admin key instead
            headers={"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else None,
        )
        app = build_app(self)
        # handler_cancellation: a client that disconnects cancels its handler, which closes the
        # engine connection; SGLang aborts a request whose connection closes.
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            keepalive_timeout=self.cfg.client_timeout_s,  # also closes a silent connection
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, reuse_address=True)
        await site.start()
        port = self._runner.addresses[0][1]
        host = self.cfg.host if ":" not in self.cfg.host else f"[{self.cfg.host}]"
        self.url = f"http://{host}:{port}"
        try:
            for w in self.registry.all():
                self.check_not_self(w.url)
        except ValueError:
            await self.stop()
            raise
        self._started = time.monotonic()
        self.health.start()
        if note := access_note(self.cfg):
            log.warning("router %s: %s", self.url, note)
        return self.url

    async def stop(self) -> None:
        """Stop probing, close the listener and the engine connections."""
        await self.health.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def router_counters(self) -> dict[str, float | int | str]:
        """Router-wide counters for `/metrics`."""
        s = self.proxy.stats
        workers = self.registry.all()
        return {
            "policy": self.cfg.policy,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "requests": s.requests,
            "succeeded": s.succeeded,
            "retries": s.retries,
            "failed": s.failed,
            "waited": s.waited,
            "bad_requests": s.bad_requests,
            "stream_broken": s.stream_broken,
            "redispatched": s.redispatched,
            "aborted_paused": s.aborted_paused,
            "paused_abort": int(self.abort_pause.active),
            "sleeps": self.sleep.sleeps,
            "wakes": self.sleep.wakes,
            "workers_sleeping": sum(w.state is WorkerState.SLEEPING for w in workers),
            "client_gone": s.client_gone,
            "session_requests": self.proxy.affinity.session_requests,
            "session_affine": self.proxy.affinity.affine,
            "workers_total": len(workers),
            "workers_healthy": len(self.registry.healthy()),
            "quarantines": sum(w.quarantines for w in workers),
            "outstanding_requests": sum(w.outstanding_requests for w in workers),
            "outstanding_tokens": sum(w.outstanding_tokens for w in workers),
            "worker_capacity_tokens": self.cfg.worker_capacity_tokens,
            "queue_length": self.dispatcher.queue_length,
            "bound_at_once": self.dispatcher.stats.bound_at_once,
            "queued": self.dispatcher.stats.queued,
            "queue_peak": self.dispatcher.stats.queue_peak,
            "queue_abandoned": self.dispatcher.stats.queue_abandoned,
            "queue_timeouts": self.dispatcher.stats.queue_timeouts,
            "group_new": self.dispatcher.affinity.stats.new if self.dispatcher.affinity else 0,
            "group_kept": self.dispatcher.affinity.stats.kept if self.dispatcher.affinity else 0,
            "group_split": self.dispatcher.affinity.stats.split if self.dispatcher.affinity else 0,
            "health_probes": self.health.probes,
            "health_probe_failures": self.health.probe_failures,
            "fanouts": self.control.fanouts,
            "fanout_failures": self.control.fanout_failures,
            "weight_generation": self.registry.weight_generation,
            **self.cfg.extra,
        }


def _refuse(_request: web.Request, status: int, message: str) -> web.Response:
    return error_response(status, message, err_type="unauthorized")


def build_app(router: Router) -> web.Application:
    """The aiohttp application with every route of the router."""
    cfg = router.cfg
    auth = auth_middleware(
        "router", api_key=cfg.api_key, admin_api_key=cfg.admin_api_key, refuse=_refuse
    )
    app = web.Application(middlewares=[auth], client_max_size=cfg.max_body_bytes)
    routes = _RegistryRoutes(router)
    gen = router.proxy.handle_generate
    app.router.add_post("/generate", gen)
    app.router.add_put("/generate", gen)
    for path in GENERATE_PATHS[1:]:
        app.router.add_post(path, gen)
    for path in INFO_PATHS:
        app.router.add_get(path, router.proxy.handle_info)
    for path in CONTROL_PATHS:
        app.router.add_post(path, router.control.handle)
    app.router.add_get("/flush_cache", router.control.handle)
    for path in SLEEP_PATHS:
        app.router.add_post(path, router.sleep.handle)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/liveness", routes.liveness)
    app.router.add_get("/readiness", routes.readiness)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_get("/workers", routes.list_workers)
    app.router.add_post("/workers", routes.add_worker)
    app.router.add_get("/workers/{worker_id}", routes.get_worker)
    app.router.add_delete("/workers/{worker_id}", routes.delete_worker)
    return app


def _parse_add_worker(raw: bytes) -> str:
    """The worker url of a `POST /workers` body; ValueError (UnicodeDecodeError,
    RecursionError) says what is wrong with it."""
    body = json.loads(raw or b"null")
    if not isinstance(body, dict) or "url" not in body:
        raise ValueError('POST /workers needs a JSON body like {"url": "http://h:p"}')
    if body.get("worker_type", "regular") != "regular":
        raise ValueError("only worker_type 'regular' is supported (no PD disaggregation)")
    return check_worker_url(body["url"])


class _RegistryRoutes:
    """The probes, `/metrics` and the worker-registry routes of one `Router`."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.reg = router.registry

    async def liveness(self, _request: web.Request) -> web.Response:
        n = len(self.reg.healthy())
        return web.json_response({"status": "ok", "healthy_workers": n})

    async def health(self, _request: web.Request) -> web.Response:
        """200 only while some engine can serve: a router with none is not healthy."""
        n = len(self.reg.healthy())
        return web.json_response(
            {"status": "ok" if n else "no_healthy_workers", "healthy_workers": n},
            status=200 if n else 503,
        )

    async def readiness(self, _request: web.Request) -> web.Response:
        n = len(self.reg.healthy())
        return web.json_response(
            {"status": "ready" if n else "not_ready", "healthy_workers": n},
            status=200 if n else 503,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        counters, workers = self.router.router_counters(), self.reg.all()
        fmt = request.query.get("format", "")
        if fmt == "prometheus" or (not fmt and "text/plain" in request.headers.get("Accept", "")):
            return web.Response(
                text=metrics_prometheus(router=counters, workers=workers),
                content_type="text/plain",
                headers={"X-Content-Type-Version": "0.0.4"},
            )
        return web.json_response(metrics_json(router=counters, workers=workers))

    async def list_workers(self, _request: web.Request) -> web.Response:
        workers = [w.to_json() for w in self.reg.all()]
        stats = {"prefill_count": 0, "decode_count": 0, "regular_count": len(workers)}
        return web.json_response({"workers": workers, "total": len(workers), "stats": stats})

    async def add_worker(self, request: web.Request) -> web.Response:
        try:
            url = _parse_add_worker(await request.read())
            self.router.check_not_self(url)
        except (ValueError, UnicodeDecodeError) as e:
            return error_response(400, str(e), err_type="invalid_request_error")
        except RecursionError:
            return error_response(
                400,
                'POST /workers body nests JSON too deeply; send {"url": "http://h:p"}',
                err_type="invalid_request_error",
            )
        existed = self.reg.find_url(url) is not None
        w = self.reg.add(url)
        self.router.health.poke(w)
        return web.json_response(
            {
                "status": "exists" if existed else "accepted",
                "worker_id": w.id,
                "url": w.url,
                "message": "worker is admitted after its first healthy /health probe",
            },
            status=202,
        )

    async def get_worker(self, request: web.Request) -> web.Response:
        w = self.reg.get(request.match_info["worker_id"])
        if w is None:
            return error_response(404, f"no worker with id {request.match_info['worker_id']!r}")
        return web.json_response(w.to_json())

    async def delete_worker(self, request: web.Request) -> web.Response:
        w = self.reg.remove(request.match_info["worker_id"])
        if w is None:
            return error_response(404, f"no worker with id {request.match_info['worker_id']!r}")
        return web.json_response(
            {
                "status": "removed",
                "worker_id": w.id,
                "url": w.url,
                "in_flight": w.outstanding_requests,
            }
        )


class RouterThread:
    """A `Router` on its own event loop in a daemon thread, for synchronous callers.

    Example:
        >>> rt = RouterThread(RouterConfig())
        >>> url = rt.start()   # doctest: +SKIP
        >>> rt.stop()          # doctest: +SKIP
    """

    def __init__(self, cfg: RouterConfig) -> None:
        self.router = Router(cfg)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="router")

    def start(self, *, timeout: float = 30.0) -> str:
        """Start the thread and the router; return its url."""
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self.router.start(), self._loop)
        return fut.result(timeout)

    def stop(self, *, timeout: float = 30.0) -> None:
        """Stop the router and join the thread."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.router.stop(), self._loop).result(timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._loop.close()


def access_note(cfg: RouterConfig) -> str | None:
    """A line for the start-up log when anyone who can reach the router may generate through it:
    no key at all, or the data plane opened on purpose (`open_data_plane`)."""
    if cfg.open_data_plane:
        return (
            "its data plane (generation, /v1/*, info, /metrics) is open to every user of this "
            "machine (--open-data-plane); the control routes need the admin key"
        )
    if not cfg.api_key and not cfg.admin_api_key:
        return "no key is set: every route is open to every user of this machine"
    return None


def warn_if_exposed(cfg: RouterConfig) -> str | None:
    """A one-line note for logs when the router listens beyond loopback."""
    if is_loopback(cfg.host):
        return None
    return (
        f"router listens on {cfg.host}: every route but /health, /liveness, /readiness and "
        "/health_generate requires a key"
    )
