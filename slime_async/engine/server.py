"""The embedded engine's HTTP server: the aiohttp application factory and the middleware every
route passes through, with SGLang's paths, bodies and status codes.

Owns: `build_app(engine)` (the routes of `routes_generate.py`, `routes_control.py` and
`openai_api.py` on one app), the per-route body limits and read deadline
(`_limits_middleware`), the key check (`router.access`: SGLang's `--api-key` and
`--admin-api-key`, run first, before any body is read), the connection cap (`cap_connections`)
and the filter for sglang-router's HTTP/2 probes. Every handler turns bad
input into HTTP 400 with a message naming the problem; nothing a client sends can crash the
server. Must never import torch model code directly (it talks to `Engine`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from router.access import auth_middleware
from slime_async.engine.engine import Engine
from slime_async.engine.http_common import (
    ENGINE_KEY,
    SMALL_BODY_BYTES,
    error,
    unreceived,
)
from slime_async.engine.openai_api import OPENAI_PATHS, add_openai_routes
from slime_async.engine.routes_control import add_control_routes
from slime_async.engine.routes_generate import add_generate_routes


class _DropHttp2Probe(logging.Filter):
    """sglang-router first probes workers with HTTP/2 prior knowledge ("PRI * HTTP/2.0"); aiohttp
    logs each probe as an error with a traceback. It is harmless (the router falls back to
    HTTP/1.1), so drop exactly those records."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


def _limits_middleware(engine: Engine) -> Any:
    """Per-route body limits (Content-Length checked before reading) and a deadline on reading
    the body, so a slow or oversized upload is refused instead of holding a connection."""
    big = int(engine.cfg.max_request_mb * 1024**2)
    timeout = engine.cfg.client_timeout_s

    @web.middleware
    async def limits(request: web.Request, handler: Any) -> web.StreamResponse:
        limit = (
            big if request.path == "/generate" or request.path in OPENAI_PATHS else SMALL_BODY_BYTES
        )
        n = request.content_length
        too_big = (
            f"{request.path} body is larger than {limit} bytes; send a smaller request "
            "(the /generate limit is --max-request-mb)"
        )
        if n is not None and n > limit:
            return error(too_big, status=413, **unreceived(request))
        if request.body_exists:
            try:
                body = await asyncio.wait_for(request.read(), timeout)
            except (TimeoutError, asyncio.TimeoutError):  # distinct classes on Python 3.10
                return error(
                    f"request body not received within {timeout:g}s",
                    status=408,
                    **unreceived(request),
                )
            except web.HTTPRequestEntityTooLarge:
                return error(too_big, status=413, **unreceived(request))
            if len(body) > limit:
                return error(too_big, status=413, **unreceived(request))
        return await handler(request)

    return limits


def cap_connections(runner: web.AppRunner, max_connections: int) -> None:
    """Answer a connection beyond `max_connections` with 503 and close it at once (call after
    `runner.setup()`)."""
    server = runner.server
    assert server is not None, "call cap_connections after runner.setup()"
    made = server.connection_made
    busy = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
        b"Content-Length: 35\r\n\r\ntoo many connections; retry later.\n"
    )

    def connection_made(handler: Any, transport: asyncio.Transport) -> None:
        made(handler, transport)
        if len(server.connections) > max_connections:
            transport.write(busy)
            transport.close()

    server.connection_made = connection_made  # type: ignore[method-assign]


def _refuse(request: web.Request, status: int, message: str) -> web.Response:
    return error(message, status=status, **unreceived(request))


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application serving `engine` (SGLang paths, plus the `get_` aliases). The key
    check runs first, so a request without the key is refused before its body is read; then
    the body limits."""
    log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _DropHttp2Probe) for f in log.filters):
        log.addFilter(_DropHttp2Probe())
    cfg = engine.cfg
    auth = auth_middleware(
        "engine", api_key=cfg.api_key, admin_api_key=cfg.admin_api_key, refuse=_refuse
    )
    app = web.Application(
        client_max_size=int(cfg.max_request_mb * 1024**2),
        middlewares=[auth, _limits_middleware(engine)],
    )
    app[ENGINE_KEY] = engine
    add_generate_routes(app)
    add_control_routes(app)
    add_openai_routes(app, engine)
    return app
