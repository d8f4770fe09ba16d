"""aiohttp routes of the embedded engine, with SGLang's paths, bodies and status codes.

Owns: `build_app(engine)`. Every handler turns bad input into HTTP 400 with a message naming the
problem; nothing a client sends can crash the server. Must never import torch model code
directly (it talks to `Engine`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any

from aiohttp import web

from slime_async.contracts.adapter import LoraSpec
from slime_async.contracts.weight_group import FLATTENED, entries_from_body
from slime_async.engine.engine import Engine, EngineState
from slime_async.engine.openai_api import OPENAI_PATHS, add_openai_routes
from slime_async.engine.protocol import GenerateRequest, parse_generate, response_item
from slime_async.engine.sampling import RequestError
from slime_async.engine.sequence import Sequence, wait_done

ENGINE_KEY = web.AppKey("engine", Engine)


class _DropHttp2Probe(logging.Filter):
    """sglang-router first probes workers with HTTP/2 prior knowledge ("PRI * HTTP/2.0"); aiohttp
    logs each probe as an error with a traceback. It is harmless (the router falls back to
    HTTP/1.1), so drop exactly those records."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


_dumps = json.dumps
_TOO_DEEP = "body nests JSON arrays/objects too deeply to parse; send a flat request"


def _err(message: str, status: int = 400, **extra: Any) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response({**body, **extra}, status=status)


def _unreceived(request: web.Request) -> dict[str, bool]:
    """On a bucket call refused before its handler ran: `received: false`, so the sender
    aborts the weight group instead of waiting on this engine (docs/weight-sync.md)."""
    return {"received": False} if request.path == "/update_weights_from_distributed" else {}


async def _json_body(request: web.Request, *, required: bool) -> dict[str, Any]:
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
        raise RequestError(_TOO_DEEP) from None
    if not isinstance(body, dict):
        raise RequestError(f"{request.path} body must be a JSON object")
    return body


SMALL_BODY_BYTES = 1 << 20
"""Body limit of every route but `/generate` (control and info bodies are tiny)."""


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
            return _err(too_big, status=413, **_unreceived(request))
        if request.body_exists:
            try:
                async with asyncio.timeout(timeout):
                    body = await request.read()
            except TimeoutError:
                return _err(
                    f"request body not received within {timeout:g}s",
                    status=408,
                    **_unreceived(request),
                )
            except web.HTTPRequestEntityTooLarge:
                return _err(too_big, status=413, **_unreceived(request))
            if len(body) > limit:
                return _err(too_big, status=413, **_unreceived(request))
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


def _eng(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]


# ---------------------------------------------------------------------------- generate
async def generate(request: web.Request) -> web.StreamResponse:
    eng = _eng(request)
    if eng.state is not EngineState.SERVING:
        return _err("engine is not serving (starting or shutting down)", status=503)
    try:
        raw = await request.read()
        try:  # a big body is parsed off the event loop (other clients keep being served)
            body = (
                json.loads(raw)
                if len(raw) < SMALL_BODY_BYTES
                else await asyncio.to_thread(json.loads, raw)
            )
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"body is not valid JSON: {e}") from None
        except RecursionError:
            raise RequestError(_TOO_DEEP) from None
        assert eng.lm is not None
        req = parse_generate(body, tokenizer=eng.lm.tokenizer, limits=eng.limits)
    except RequestError as e:
        return _err(str(e))
    async with eng.model_lock.reader():  # SGLang: a request reads the model for its whole life
        try:
            return await _serve(request, eng, req)
        except RequestError as e:  # its adapter was unloaded between parse and submit
            return _err(str(e))


async def _serve(request: web.Request, eng: Engine, req: GenerateRequest) -> web.StreamResponse:
    seqs = eng.submit(req)
    rtl = req.items[0].return_text_in_logprobs
    tok = eng.lm.tokenizer  # type: ignore[union-attr]
    if req.stream:
        return await _stream(request, eng, seqs, batch=req.batch, rtl=rtl)
    if not await wait_done(
        seqs, lambda: _client_gone(request)
    ):  # client went away: free the batch rows
        eng.abort_seqs(seqs, "client disconnected")
        return web.Response(status=499)
    for s in seqs:  # an internal error is an HTTP error (SGLang), not a partial answer
        code = (s.finish_reason or {}).get("status_code")
        if code is not None and code >= 400:
            return _err(s.finish_reason["message"], status=code)  # type: ignore[index]
    outs = [response_item(s, tokenizer=tok, return_text_in_logprobs=rtl) for s in seqs]
    return web.json_response(outs if req.batch else outs[0], dumps=_dumps)


async def _stream(
    request: web.Request, eng: Engine, seqs: list[Sequence], *, batch: bool, rtl: bool
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    tok = eng.lm.tokenizer  # type: ignore[union-attr]
    sent = [-1] * len(seqs)
    try:
        pending = set(range(len(seqs)))
        while pending:
            waits = {asyncio.ensure_future(seqs[i].updated.wait()): i for i in pending}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for f in waits:
                f.cancel()
            for i in list(pending):
                s = seqs[i]
                s.updated.clear()
                finished = s.finish_reason is not None
                if len(s.output) == sent[i] and not finished:
                    continue
                sent[i] = len(s.output)
                code = (s.finish_reason or {}).get("status_code")
                if finished and code is not None and code >= 400:  # SGLang's mid-stream error
                    err = {"message": s.finish_reason["message"], "type": "invalid_request_error"}  # type: ignore[index]
                    err.update(code=code, retryable=code >= 500)
                    await resp.write(f"data: {_dumps({'error': err})}\n\n".encode())
                    pending.discard(i)
                    continue
                item = response_item(
                    s, tokenizer=tok, return_text_in_logprobs=rtl, index=i if batch else None
                )
                await resp.write(f"data: {_dumps(item)}\n\n".encode())
                if finished:
                    pending.discard(i)
        await resp.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        eng.abort_seqs(seqs, "client disconnected")
        raise
    return resp


# ---------------------------------------------------------------------------- control
async def pause_generation(request: web.Request) -> web.Response:
    eng = _eng(request)
    try:
        body = await _json_body(request, required=True)
        mode = eng.pause_mode(body.get("mode", "abort"))
    except (RequestError, ValueError) as e:
        return _err(str(e))
    await eng.pause(mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    _eng(request).resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    eng = _eng(request)
    try:
        body = await _json_body(request, required=True)
    except RequestError as e:
        return _err(str(e))
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool) or (rid is not None and not isinstance(rid, str)):
        return _err("abort_request takes {rid: str} or {abort_all: true}")
    if rid is None and not abort_all:
        return _err("abort_request needs `rid` or `abort_all: true`")
    eng.abort(rid=rid, abort_all=abort_all)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    if _eng(request).flush_cache():
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.")
    return web.Response(status=400, text="Cache not flushed: requests are running; retry later.")


def _bool_field(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise RequestError(f"{key} must be true or false")
    return v


def _version_field(body: dict[str, Any]) -> str | None:
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str | int):
        raise RequestError("weight_version must be a string")
    return None if version is None else str(version)


def _update_reply(res: Any) -> web.Response:
    body = {
        "success": res.success,
        "message": res.message,
        "num_paused_requests": res.num_paused_requests,
    }
    if res.received is not None:
        body["received"] = res.received
    if getattr(res, "group_broken", False):
        body["group_broken"] = True
    return web.json_response(body, status=200 if res.success else 400)


def _refuse(message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": False, "message": message, **extra}, status=400)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    eng = _eng(request)
    try:
        body = await _json_body(request, required=True)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise RequestError("update_weights_from_disk needs `model_path` (a directory)")
        version = _version_field(body)
        abort_all = _bool_field(body, "abort_all_requests", False)
        flush = _bool_field(body, "flush_cache", True)
    except RequestError as e:
        return _refuse(str(e))
    res = await eng.update_weights_from_disk(
        path, weight_version=version, abort_all_requests=abort_all, flush_cache=flush
    )
    return _update_reply(res)


async def init_weights_update_group(request: web.Request) -> web.Response:
    eng = _eng(request)
    try:
        body = await _json_body(request, required=True)
        addr, port = body.get("master_address"), body.get("master_port")
        offset, size = body.get("rank_offset"), body.get("world_size")
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if not isinstance(addr, str) or not addr:
            raise RequestError("init_weights_update_group needs `master_address` (rank 0's IP)")
        for key, v in (("master_port", port), ("rank_offset", offset), ("world_size", size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise RequestError(f"init_weights_update_group needs `{key}` (an integer >= 0)")
        if not 0 < offset < size:
            raise RequestError(
                f"rank_offset {offset} must be in 1..world_size-1 ({size}): rank 0 is the sender"
            )
        if not isinstance(name, str) or not name:
            raise RequestError("group_name must be a non-empty string")
        if backend != "gloo":
            raise RequestError(
                f"backend {backend!r}: the embedded engine serves from CPU memory and joins weight "
                "groups over gloo; send backend 'gloo' (NCCL is for SGLang engines on GPUs)"
            )
    except RequestError as e:
        return _refuse(str(e))
    res = await eng.init_weights_update_group(
        master_address=addr,
        master_port=port,
        rank_offset=offset,
        world_size=size,
        group_name=name,
        backend=backend,
    )
    return web.json_response(
        {"success": res.success, "message": res.message}, status=200 if res.success else 400
    )


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    eng = _eng(request)
    try:
        body = await _json_body(request, required=False)
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            raise RequestError("group_name must be a string")
    except RequestError as e:
        return _refuse(str(e))
    res = eng.destroy_weights_update_group(name)
    return web.json_response(
        {"success": res.success, "message": res.message}, status=200 if res.success else 400
    )


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    eng = _eng(request)
    try:
        body = await _json_body(request, required=True)
        try:
            entries = entries_from_body(body.get("names"), body.get("dtypes"), body.get("shapes"))
        except ValueError as e:
            raise RequestError(f"update_weights_from_distributed: {e}") from None
        name = body.get("group_name", "weight_update_group")
        if not isinstance(name, str):
            raise RequestError("group_name must be a string")
        fmt = body.get("load_format")
        if fmt not in (None, FLATTENED):
            raise RequestError(f"load_format must be null or {FLATTENED!r}, got {fmt!r}")
        if fmt == FLATTENED and len({e.dtype for e in entries}) != 1:
            raise RequestError(f"a {FLATTENED} bucket must hold tensors of one dtype")
        selector = body.get("selector", "target")
        if selector not in ("target", "all"):
            raise RequestError(f"selector {selector!r}: this engine has no draft model")
        version = _version_field(body)
        abort_all = _bool_field(body, "abort_all_requests", False)
        flush = _bool_field(body, "flush_cache", True)
        lora_name, lora_spec = _adapter_fields(body)
    except RequestError as e:
        # refused before receiving: the sender must abort the group (docs/weight-sync.md)
        return _refuse(str(e), received=False)
    res = await eng.update_weights_from_distributed(
        entries,
        group_name=name,
        load_format=fmt,
        weight_version=version,
        abort_all_requests=abort_all,
        flush_cache=flush,
        lora_name=lora_name,
        lora_spec=lora_spec,
    )
    return _update_reply(res)


def _adapter_fields(body: dict[str, Any]) -> tuple[str | None, LoraSpec | None]:
    """Our extension of `/update_weights_from_distributed`: `lora_name` + `lora_config` (the
    adapter's `adapter_config.json` as a JSON object) say the bucket holds that adapter's
    tensors in PEFT's names (docs/lora.md); both absent: model weights, as in SGLang."""
    name, cfg = body.get("lora_name"), body.get("lora_config")
    if name is None and cfg is None:
        return None, None
    if not isinstance(name, str) or not name or not isinstance(cfg, dict):
        raise RequestError(
            "adapter buckets need `lora_name` (a non-empty string) and `lora_config` (the "
            "adapter_config.json object) together"
        )
    try:
        return name, LoraSpec.from_peft_config(cfg)
    except ValueError as e:
        raise RequestError(f"lora_config: {e}") from None


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """SGLang's payload is pickled (MultiprocessingSerializer; CUDA IPC handles between
    colocated processes). Network data is never unpickled here: refuse, naming the alternatives."""
    return _refuse(
        "update_weights_from_tensor carries pickled tensors (SGLang's MultiprocessingSerializer, "
        "CUDA IPC handles for a colocated trainer); this engine never unpickles request data. "
        "Use update_weights_from_distributed (a weight update group) or update_weights_from_disk."
    )


async def update_weight_version(request: web.Request) -> web.Response:
    eng = _eng(request)
    try:
        body = await _json_body(request, required=True)
        new = body.get("new_version")
        if new is None or not isinstance(new, str | int):
            raise RequestError("update_weight_version needs `new_version` (a string)")
        abort_all = body.get("abort_all_requests", True)
        if not isinstance(abort_all, bool):
            raise RequestError("abort_all_requests must be true or false")
    except RequestError as e:
        return web.json_response({"success": False, "message": str(e)}, status=400)
    res = await eng.update_weight_version(str(new), abort_all_requests=abort_all)
    return web.json_response(
        {"success": res.success, "message": res.message, "new_version": str(new)}
    )


async def memory_occupation(request: web.Request) -> web.Response:
    """release/resume_memory_occupation: accepted for API parity; a CPU engine keeps its memory."""
    return web.json_response(None)


# ---------------------------------------------------------------------------- info and health
async def health(request: web.Request) -> web.Response:
    ok = _eng(request).state is EngineState.SERVING
    return web.Response(status=200 if ok else 503)


async def health_generate(request: web.Request) -> web.Response:
    eng = _eng(request)
    if eng.state is not EngineState.SERVING:
        return web.Response(status=503)
    from slime_async.engine.protocol import GenerateItem, GenerateRequest
    from slime_async.engine.sampling import SamplingParams

    rid = f"HEALTH_CHECK_{id(request)}"
    item = GenerateItem(
        rid=rid,
        group_rid=rid,
        prompt=[0],
        params=SamplingParams(max_new_tokens=1, temperature=0.0),
        return_logprob=False,
        logprob_start_len=-1,
        return_text_in_logprobs=False,
        return_routed_experts=False,
        routed_start=0,
    )
    (seq,) = eng.submit(GenerateRequest(items=[item], batch=False, stream=False))
    try:
        await asyncio.wait_for(seq.done.wait(), eng.cfg.health_generate_timeout_s)
    except TimeoutError:
        eng.abort_seqs([seq], "health check timed out")
        return web.Response(status=503)
    aborted = (seq.finish_reason or {}).get("type") == "abort"
    return web.Response(status=503 if aborted else 200)


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(_eng(request).model_info())


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(_eng(request).server_info())


async def get_load(request: web.Request) -> web.Response:
    return web.json_response([_eng(request).load()])


async def v1_loads(request: web.Request) -> web.Response:
    return web.json_response({"loads": [_eng(request).load()]})


# ---------------------------------------------------------------------------- LoRA adapters
def _lora_reply(eng: Engine, res: Any) -> web.Response:
    """SGLang's `LoRAUpdateResult`: success, error_message, loaded_adapters (400 on failure)."""
    lora = eng.lm.lora if eng.lm is not None else None
    body = {
        "success": res.success,
        "error_message": None if res.success else res.message,
        "loaded_adapters": lora.loaded() if lora is not None else {},
    }
    return web.json_response(body, status=200 if res.success else 400)


def _name_field(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v:
        raise RequestError(f"{key} must be a non-empty string")
    return v


async def load_lora_adapter(request: web.Request) -> web.Response:
    """`{lora_name, lora_path[, pinned][, weight_version]}`: a PEFT directory (safetensors only)
    staged and checked before it serves; `weight_version` replaces a loaded adapter of that
    name in place (a versioned push). Our extension `{lora_name, weight_version,
    from_distributed: true}` (no `lora_path`) activates the adapter of that version received
    over a weight group (`/update_weights_from_distributed` with `lora_name`)."""
    eng = _eng(request)
    try:
        body = await _json_body(request, required=True)
        name = _name_field(body, "lora_name")
        received = _bool_field(body, "from_distributed", False)
        path = None if received else _name_field(body, "lora_path")
        if received and body.get("lora_path") is not None:
            raise RequestError("from_distributed takes no lora_path: send one or the other")
        _bool_field(body, "pinned", False)  # SGLang's: nothing is evicted here
        version = _version_field(body)
        if received and version is None:
            raise RequestError("from_distributed needs the weight_version that was received")
    except RequestError as e:
        return _err(str(e))
    res = await eng.load_lora_adapter(name, path, weight_version=version, from_distributed=received)
    return _lora_reply(eng, res)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    eng = _eng(request)
    try:
        name = _name_field(await _json_body(request, required=True), "lora_name")
    except RequestError as e:
        return _err(str(e))
    return _lora_reply(eng, await eng.unload_lora_adapter(name))


async def load_lora_adapter_from_tensors(request: web.Request) -> web.Response:
    """SGLang's payload is pickled (the unauthenticated-RCE route of CVE-2026-15969): refused."""
    return _err(
        "load_lora_adapter_from_tensors carries pickled tensors; this engine never unpickles "
        "request data. Write a PEFT directory and use /load_lora_adapter."
    )


def _auth_middleware(token: str) -> Any:
    """Every route needs `Authorization: Bearer <token>` (compared in constant time)."""
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            return _err(
                f"{request.path} needs 'Authorization: Bearer <token>' (the run's shared token, "
                "$SLIME_ASYNC_AUTH_TOKEN)",
                status=401,
                **_unreceived(request),
            )
        return await handler(request)

    return auth


def build_app(engine: Engine) -> web.Application:
    """The aiohttp application serving `engine` (SGLang paths, plus the `get_` aliases); with
    `auth_token` set, every route requires it."""
    log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _DropHttp2Probe) for f in log.filters):
        log.addFilter(_DropHttp2Probe())
    token = engine.cfg.auth_token
    app = web.Application(
        client_max_size=int(engine.cfg.max_request_mb * 1024**2),
        middlewares=[_limits_middleware(engine)] + ([_auth_middleware(token)] if token else []),
    )
    app[ENGINE_KEY] = engine
    r = app.router
    for path in ("/generate",):
        r.add_post(path, generate)
        r.add_put(path, generate)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_post("/load_lora_adapter", load_lora_adapter)
    r.add_post("/unload_lora_adapter", unload_lora_adapter)
    r.add_post("/load_lora_adapter_from_tensors", load_lora_adapter_from_tensors)
    r.add_route("*", "/release_memory_occupation", memory_occupation)
    r.add_route("*", "/resume_memory_occupation", memory_occupation)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_get("/ready", health)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/get_load", get_load)
    r.add_get("/v1/loads", v1_loads)
    add_openai_routes(app, engine)
    return app


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
