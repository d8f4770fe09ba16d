"""What every route module of the embedded engine's HTTP server shares: the app key that holds
the `Engine`, SGLang's error body, the JSON body reader, and the small-body limit.

Owns: `ENGINE_KEY`, `engine_of`, `error`, `unreceived`, `json_body`, `client_gone`,
`SMALL_BODY_BYTES`, `TOO_DEEP`. Bad input becomes a `RequestError` (the routes answer it with 400). Must never import
torch model code (the routes talk to `Engine`).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from slime_async.engine.engine import Engine
from slime_async.engine.sampling import RequestError

ENGINE_KEY = web.AppKey("engine", Engine)

SMALL_BODY_BYTES = 1 << 20
"""Body limit of every route but `/generate` (control and info bodies are tiny)."""

TOO_DEEP = "body nests JSON arrays/objects too deeply to parse; send a flat request"


def engine_of(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]


def error(message: str, status: int = 400, **extra: Any) -> web.Response:
    """SGLang's error body: `{"error": {message, type, code}}` (plus `extra` keys)."""
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response({**body, **extra}, status=status)


def unreceived(request: web.Request) -> dict[str, bool]:
    """On a bucket call refused before its handler ran: `received: false`, so the sender
    aborts the weight group instead of waiting on this engine (docs/weight-sync.md)."""
    return {"received": False} if request.path == "/update_weights_from_distributed" else {}


async def json_body(request: web.Request, *, required: bool) -> dict[str, Any]:
    """The request's JSON object (`{}` for an empty body unless `required`)."""
    raw = await request.read()
    if not raw.strip():
        if required:
            raise RequestError(f"{request.path} needs a JSON object body")
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError(TOO_DEEP) from None
    if not isinstance(body, dict):
        raise RequestError(f"{request.path} body must be a JSON object")
    return body


def client_gone(request: web.Request) -> bool:
    """Whether the client of `request` went away (its request is then aborted)."""
    transport = request.transport
    return transport is None or transport.is_closing()
