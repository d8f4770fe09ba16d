"""Request forwarding: pick an engine, forward bytes untouched, retry elsewhere on failure.

Owns: `Proxy` (the `/generate`, `/v1/*` and read-only info handlers), `ProxyStats`,
`parse_expected_tokens`, `error_response`. A request with `X-Session-ID` goes first to its
session's engine (`router.session_affinity`) when that engine is healthy; retries go elsewhere.
Contract: request and response bodies pass through byte for byte (`meta_info`, `routed_experts`,
`weight_version` included; with `cache_salt`, generate bodies gain SGLang's `extra_key`,
router/cache_salt.py); the group a request belongs to (router/affinity.py) steers its binding; a request is answered exactly once; a retry happens only while
nothing has been sent to the client (connection error, timeout or 5xx before the first byte), on
at most `MAX_ENGINES_PER_REQUEST` engines; a 4xx is the client's fault: passed through, never
retried and never counted against the engine. A non-streamed request cut by its engine's
preemption (router/sleep.py: aborted, or refused asleep, after the engine was put to sleep
under it) is sent whole to another engine and counted (`redispatched`): its partial output is
dropped, so the client gets exactly one complete answer. A streamed one has sent bytes already:
it ends with its abort chunk, as in SGLang.
Must never import: `slime_async`, or the server/health modules (it gets callbacks instead).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from router.affinity import GROUP_KEY_HEADER, group_key
from router.cache_salt import salt_body
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.pause import AbortPause, aborted_response
from router.session_affinity import (
    SESSION_HEADER,
    AffinityStats,
    affine_worker,
    check_session_id,
)
from router.workers import Worker, WorkerRegistry

EXPECTED_TOKENS_HEADER = "X-Expected-Tokens"
_SSE = "text/event-stream"
_RETRYABLE_EXC = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
_BIG_BODY = 1 << 20
"""Bodies at least this large are JSON-validated in a worker thread."""
MAX_ENGINES_PER_REQUEST = 2
"""A request that failed on this many distinct engines is answered with its last error, never
tried on a third: what fails on two engines is most likely the request, not the engines, and
retrying it further would only spread the damage (and the quarantine streaks) over the fleet."""


@dataclass(slots=True)
class ProxyStats:
    """Router-wide request counters (exported by `/metrics`)."""

    requests: int = 0
    succeeded: int = 0
    retries: int = 0
    failed: int = 0
    """Requests answered with a router error (no engine within the wait, retries exhausted)."""
    waited: int = 0
    """Requests that had to wait for a healthy engine."""
    bad_requests: int = 0
    stream_broken: int = 0
    """Streams that lost their engine after bytes were sent (client got an SSE error event)."""
    client_gone: int = 0
    """Streams whose client disconnected (the engine request is closed, which aborts it)."""
    redispatched: int = 0
    """Requests cut by an engine's preemption (sleep) and sent whole to another engine."""
    aborted_paused: int = 0
    """Generate requests answered aborted by the router during an abort-mode pause
    (router/pause.py)."""


class _Preempted(Exception):
    """The engine was put to sleep while this request ran on it and answered it aborted (or
    refused it asleep): nothing reached the client, the request goes whole to another engine."""


def _cut(status: int, data: bytes) -> bool:
    """A response of an engine preempted under the request: refused asleep (503), failed, or finished
    with `finish_reason` abort (any item of a batch)."""
    if status >= 500:
        return True
    if status != 200:
        return False
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    items = obj if isinstance(obj, list) else [obj]
    for it in items:
        meta = it.get("meta_info") if isinstance(it, dict) else None
        reason = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(reason, dict) and reason.get("type") == "abort":
            return True
        choices = it.get("choices") if isinstance(it, dict) else None  # the OpenAI routes
        if isinstance(choices, list) and any(
            isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices
        ):
            return True
    return False


class _Retryable(Exception):
    def __init__(self, message: str, *, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


def error_response(status: int, message: str, *, err_type: str = "router_error") -> web.Response:
    """A JSON error body in SGLang's shape: `{"error": {"message", "type", "code"}}`."""
    return web.json_response(
        {"error": {"message": message, "type": err_type, "code": status}}, status=status
    )


def _gave_up(e: _Retryable, *, attempts: int, last_error: str) -> web.Response:
    """The answer once every attempt failed: the engine's own 5xx answer passed through (once),
    else a 502 naming the last error."""
    if e.status is not None:
        return web.Response(status=e.status, body=e.body, content_type="text/plain")
    return error_response(502, f"all {attempts} attempts failed: {last_error}")


def parse_expected_tokens(raw: str | None, default: int) -> int:
    """The request's expected response tokens from its header value, or `default` if absent."""
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(
            f"header {EXPECTED_TOKENS_HEADER}: {raw!r} is not an integer; send the expected "
            "number of response tokens (e.g. 'X-Expected-Tokens: 2048') or omit the header"
        ) from None
    if value < 0:
        raise ValueError(f"header {EXPECTED_TOKENS_HEADER} must be >= 0, got {value}")
    return value


def _validate_body(path: str, body: bytes) -> Any:
    """Raise ValueError with a clear message if `body` is not a request SGLang could accept;
    returns the parsed body."""
    if not body:
        raise ValueError(f"{path} needs a JSON body; got an empty request")
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} body is not valid JSON ({e}); send a JSON object") from None
    except RecursionError:
        raise ValueError(
            f"{path} body nests JSON arrays/objects too deeply to parse; send a flat request"
        ) from None
    if path == "/generate":
        if not isinstance(obj, dict | list) or (isinstance(obj, list) and not obj):
            raise ValueError("/generate body must be a JSON object (or a non-empty list of them)")
        items = obj if isinstance(obj, list) else [obj]
        for item in items:
            if not isinstance(item, dict):
                raise ValueError("/generate list items must be JSON objects")
            if not any(k in item for k in ("text", "input_ids", "input_embeds")):
                raise ValueError("/generate body needs one of 'text', 'input_ids', 'input_embeds'")
            sp = item.get("sampling_params")
            if sp is not None and not isinstance(sp, dict | list):
                raise ValueError("/generate 'sampling_params' must be an object")
    elif not isinstance(obj, dict):
        raise ValueError(f"{path} body must be a JSON object")
    elif path == "/v1/chat/completions" and not isinstance(obj.get("messages"), list):
        raise ValueError("/v1/chat/completions body needs a 'messages' list")
    elif path == "/v1/completions" and "prompt" not in obj:
        raise ValueError("/v1/completions body needs a 'prompt'")
    return obj


class Proxy:
    """Forwards client requests to engines chosen by a policy, with retry and bounded waiting."""

    def __init__(
        self,
        *,
        cfg: RouterConfig,
        registry: WorkerRegistry,
        dispatcher: Dispatcher,
        session: Callable[[], aiohttp.ClientSession],
        on_failure: Callable[[Worker], None],
        salt: Callable[[], str] | None = None,
        pause: AbortPause | None = None,
    ) -> None:
        self.cfg = cfg
        self.pause = pause if pause is not None else AbortPause()
        """The fleet's abort-mode pause: generate requests are answered aborted meanwhile."""
        self.registry = registry
        self.dispatcher = dispatcher
        self._session = session
        self._on_failure = on_failure
        self._salt = salt
        """The current prefix-cache salt, when `/generate` bodies carry one (cache_salt.py)."""
        self.stats = ProxyStats()
        self.affinity = AffinityStats()
        self._timeout = aiohttp.ClientTimeout(
            total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s
        )
        self._urls: dict[tuple[str, str], URL] = {}

    def _url(self, base: str, path_qs: str) -> URL:
        """Parsed upstream URL, cached (parsing dominates the per-request cost otherwise)."""
        key = (base, path_qs)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) > 4096:
                self._urls.clear()
            url = self._urls[key] = URL(base + path_qs, encoded=True)
        return url

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        """`/generate`, `/v1/completions`, `/v1/chat/completions`: validate, then forward."""
        self.stats.requests += 1
        try:
            expected = parse_expected_tokens(
                request.headers.get(EXPECTED_TOKENS_HEADER), self.cfg.default_expected_tokens
            )
            session = check_session_id(request.headers.get(SESSION_HEADER))
            try:
                body = await asyncio.wait_for(request.read(), self.cfg.client_timeout_s)
            except (TimeoutError, asyncio.TimeoutError):  # distinct classes on Python 3.10
                return error_response(
                    408, f"request body not received within {self.cfg.client_timeout_s:g}s"
                )
            if len(body) < _BIG_BODY:
                obj = _validate_body(request.path, body)
            else:  # parsing a big body must not stall every other client on the event loop
                obj = await asyncio.to_thread(_validate_body, request.path, body)
        except ValueError as e:
            self.stats.bad_requests += 1
            return error_response(400, str(e), err_type="invalid_request_error")
        group = group_key(
            request.headers.get(GROUP_KEY_HEADER), obj, by_prompt=self.cfg.group_affinity_by_prompt
        )
        return await self.forward(
            request,
            body=body,
            expected_tokens=expected,
            group=group,
            # the cache salt goes into SGLang's native /generate bodies only
            parsed=obj if request.path == "/generate" else None,
            session=session,
            abortable=True,
        )

    async def handle_info(self, request: web.Request) -> web.StreamResponse:
        """Read-only engine routes (`/get_model_info`, ...): answered by one healthy engine."""
        self.stats.requests += 1
        return await self.forward(request, body=await request.read(), expected_tokens=0)

    async def _candidates(
        self, tried: set[str], deadline: float, *, abortable: bool = False
    ) -> list[Worker]:
        """Healthy engines not tried yet (all healthy ones once every engine was tried);
        waits up to `deadline` while none is healthy; empty list on timeout, or (`abortable`)
        once an abort-mode pause begins."""
        waited = False
        while True:
            healthy = self.registry.healthy()
            if healthy:
                return [w for w in healthy if w.id not in tried] or healthy
            if not waited:
                self.stats.waited += 1
                waited = True
            if abortable and self.pause.active:
                return []
            if not await self._wait_for_healthy(deadline, abortable=abortable):
                return []

    async def _wait_for_healthy(self, deadline: float, *, abortable: bool) -> bool:
        """`registry.wait_for_healthy` until `deadline`; an abortable request stops waiting
        when an abort-mode pause begins (False then)."""
        healthy = asyncio.ensure_future(self.registry.wait_for_healthy(deadline - time.monotonic()))
        if not abortable:
            return await healthy
        paused = asyncio.ensure_future(self.pause.wait_begun())
        try:
            await asyncio.wait({healthy, paused}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            paused.cancel()
            if not healthy.done():
                healthy.cancel()
        return not healthy.cancelled() and healthy.result()

    async def forward(
        self,
        request: web.Request,
        *,
        body: bytes,
        expected_tokens: int,
        group: str | None = None,
        parsed: Any = None,
        session: str | None = None,
        abortable: bool = False,
    ) -> web.StreamResponse:
        """Send `body` to an engine (the session's first, when one is named and healthy, else
        the group's: router/affinity.py); retry on another engine while nothing was streamed.
        An `abortable` (generate) request is answered aborted by the router instead whenever it
        would be sent during an abort-mode pause (router/pause.py)."""
        deadline = time.monotonic() + self.cfg.wait_for_worker_s
        tried: set[str] = set()
        last_error = "no attempt"
        path_qs = request.path_qs
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        attempt = 0  # failed attempts; a preemption is not one (the engine did nothing wrong)
        while True:
            if abortable and self.pause.active:
                return await self._aborted(request, body)
            candidates = await self._candidates(tried, deadline, abortable=abortable)
            if abortable and self.pause.active:
                return await self._aborted(request, body)
            if not candidates:
                return self._failed(
                    f"no healthy engine became available within {self.cfg.wait_for_worker_s:g}s "
                    f"({len(self.registry.all())} registered); last error: {last_error}"
                )
            affine = None
            if session is not None and attempt == 0:
                affine = affine_worker(session, self.registry.healthy())
                if affine is not None and affine in candidates:
                    candidates = [affine]
            # Bound now, or later from the router's queue (late binding, router/dispatch.py).
            w = await self.dispatcher.acquire(
                candidates, expected_tokens, exclude=tried, retry=bool(tried), group=group
            )
            if w is None:
                return self._failed(
                    f"no healthy engine for {self.cfg.wait_for_worker_s:g}s while queued"
                )
            if abortable and self.pause.active:  # the pause began while it waited for room
                self.dispatcher.release(w, expected_tokens)
                return await self._aborted(request, body)
            tried.add(w.id)
            w.total_requests += 1
            sent = self._salted(body, parsed)
            if session is not None and attempt == 0:
                self.affinity.session_requests += 1
                self.affinity.affine += w is affine
            try:
                resp = await self._attempt(request, w, path_qs, sent, headers)
            except _Preempted:
                self.stats.redispatched += 1
                tried.discard(w.id)  # it may serve again once awake
                deadline = time.monotonic() + self.cfg.wait_for_worker_s
                continue
            except _Retryable as e:
                last_error = f"{w.url}: {e}"
                self._retried_away(w, e)
                if attempt < self.cfg.max_retries and len(tried) < MAX_ENGINES_PER_REQUEST:
                    self.stats.retries += 1
                    await asyncio.sleep(min(self.cfg.retry_backoff_s * 2**attempt, 1.0))
                    attempt += 1
                    continue
                self.stats.failed += 1
                return _gave_up(e, attempts=attempt + 1, last_error=last_error)
            finally:
                self.dispatcher.release(w, expected_tokens)
            self.registry.record_request_success(w)
            self.stats.succeeded += 1
            return resp

    async def _aborted(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """The router's own aborted answer during an abort-mode pause (counted)."""
        self.stats.aborted_paused += 1
        self.pause.answered += 1
        return await aborted_response(request, request.path, body)

    def _failed(self, message: str) -> web.Response:
        """A 503 for a request that found no engine (counted as failed)."""
        self.stats.failed += 1
        return error_response(503, message)

    def _salted(self, body: bytes, parsed: Any) -> bytes:
        """`body` with the cache salt, when one is bound and the body is a parsed /generate."""
        if self._salt is not None and parsed is not None:
            return salt_body(body, parsed, self._salt())  # the salt when it is bound
        return body

    def _retried_away(self, w: Worker, e: _Retryable) -> None:
        """Count a retryable failure of `w` against it (the request moves on or gives up)."""
        w.retries_away += 1
        self.registry.record_request_failure(w, str(e))
        self._on_failure(w)

    async def _attempt(
        self, request: web.Request, w: Worker, path_qs: str, body: bytes, headers: dict
    ) -> web.StreamResponse:
        """One try on `w`. Raises `_Retryable` only while the client has received nothing, and
        `_Preempted` when `w` was put to sleep under the request and answered it cut."""
        epoch = w.preemptions
        try:
            async with self._session().request(
                request.method,
                self._url(w.url, path_qs),
                data=body,
                headers=headers,
                timeout=self._timeout,
            ) as up:
                if up.status >= 500 and w.preemptions == epoch:
                    raise _Retryable(f"HTTP {up.status}", status=up.status, body=await up.read())
                ctype = up.headers.get("Content-Type", "application/octet-stream")
                if not ctype.startswith(_SSE):
                    data = await up.read()
                    if w.preemptions != epoch and _cut(up.status, data):
                        raise _Preempted
                    return web.Response(
                        status=up.status, body=data, headers={"Content-Type": ctype}
                    )
                return await self._stream(request, w, up, ctype)
        except _RETRYABLE_EXC as e:
            if w.preemptions != epoch:  # the connection died with the preempted request
                raise _Preempted from None
            raise _Retryable(f"{type(e).__name__}: {e}") from None

    async def _stream(
        self, request: web.Request, w: Worker, up: aiohttp.ClientResponse, ctype: str
    ) -> web.StreamResponse:
        first = await up.content.readany()  # a failure here is still retryable
        out = web.StreamResponse(
            status=up.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"}
        )
        # From here on bytes reach the client: nothing below may raise `_Retryable`.
        try:
            await out.prepare(request)
            chunk = first
            while chunk:
                await out.write(chunk)
                try:
                    chunk = await up.content.readany()
                except _RETRYABLE_EXC as e:
                    await self._stream_broken(out, w, e)
                    break
            await out.write_eof()
        except (ConnectionError, RuntimeError):  # the client went away: not the engine's fault
            self.stats.client_gone += 1  # leaving closes the engine connection (SGLang aborts)
        return out

    async def _stream_broken(self, out: web.StreamResponse, w: Worker, e: Exception) -> None:
        """The engine failed after bytes were sent: no retry (it would duplicate output); end the
        stream with SGLang's mid-stream error event and count the engine failure."""
        self.stats.stream_broken += 1
        self.registry.record_request_failure(w, f"stream broken: {e}")
        self._on_failure(w)
        err = {
            "error": {
                "message": f"engine {w.url} failed mid-stream: {type(e).__name__}",
                "type": "engine_error",
                "code": 502,
                "retryable": True,
            }
        }
        await out.write(b"data: " + json.dumps(err).encode() + b"\n\n")
