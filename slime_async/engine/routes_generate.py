"""The embedded engine's data-plane routes: `/generate` (JSON or SSE stream), health and
readiness (`/health`, `/health_generate`, `/ready`), and the info routes (`/model_info`,
`/server_info` with their `get_` aliases, `/get_load`, `/v1/loads`), with SGLang's paths, bodies
and status codes.

Owns: `add_generate_routes(app)` and the handlers. Every `/generate` holds the engine's model
lock as a reader for its whole life (SGLang's rule, `engine.py`); a client that goes away
aborts its request. Bad input is answered 400 with a message naming the problem. Must never
import torch model code (it talks to `Engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from aiohttp import web

from slime_async.engine.engine import Engine, EngineState
from slime_async.engine.http_common import (
    SMALL_BODY_BYTES,
    TOO_DEEP,
    client_gone,
    engine_of,
    error,
)
from slime_async.engine.protocol import (
    GenerateItem,
    GenerateRequest,
    parse_generate,
    response_item,
)
from slime_async.engine.sampling import RequestError, SamplingParams
from slime_async.engine.sequence import Sequence, wait_done
from slime_async.engine.vision import with_images

HEALTH_POLL_S = 0.05
"""How often `/health_generate` looks for output while it waits."""

_dumps = json.dumps


def add_generate_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/generate", generate)
    r.add_put("/generate", generate)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_get("/ready", health)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/get_load", get_load)
    r.add_get("/v1/loads", v1_loads)


async def generate(request: web.Request) -> web.StreamResponse:
    eng = engine_of(request)
    if eng.state is not EngineState.SERVING:
        return error("engine is not serving (starting or shutting down)", status=503)
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
            raise RequestError(TOO_DEEP) from None
        assert eng.lm is not None
        req = parse_generate(body, tokenizer=eng.lm.tokenizer, limits=eng.limits)
        if eng.lm.vision is not None or any(it.image_data for it in req.items):
            req = await asyncio.to_thread(with_images, req, eng)  # decoding is CPU work
    except RequestError as e:
        return error(str(e))
    async with eng.model_lock.reader():  # SGLang: a request reads the model for its whole life
        if eng.memory.sleeping:  # checked under the lock: a release never overlaps a request
            return error(eng.memory.why_asleep(), status=503)
        try:
            return await _serve(request, eng, req)
        except RequestError as e:  # its adapter was unloaded between parse and submit
            return error(str(e))


async def _serve(request: web.Request, eng: Engine, req: GenerateRequest) -> web.StreamResponse:
    seqs = eng.submit(req)
    rtl = req.items[0].return_text_in_logprobs
    tok = eng.lm.tokenizer  # type: ignore[union-attr]
    if req.stream:
        return await _stream(request, eng, seqs, batch=req.batch, rtl=rtl)
    if not await wait_done(
        seqs, lambda: client_gone(request)
    ):  # client went away: free the batch rows
        eng.abort_seqs(seqs, "client disconnected")
        return web.Response(status=499)
    for s in seqs:  # an internal error is an HTTP error (SGLang), not a partial answer
        code = (s.finish_reason or {}).get("status_code")
        if code is not None and code >= 400:
            return error(s.finish_reason["message"], status=code)  # type: ignore[index]
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


async def health(request: web.Request) -> web.Response:
    ok = engine_of(request).state is EngineState.SERVING
    return web.Response(status=200 if ok else 503)


async def health_generate(request: web.Request) -> web.Response:
    """SGLang's: submit a 1-token request and answer 200 as soon as the scheduler produces any
    output (that request's token, or any other sequence's: a busy engine with a deep queue is
    healthy), 503 if none comes within `health_generate_timeout_s`."""
    eng = engine_of(request)
    if eng.state is not EngineState.SERVING or eng.memory.sleeping or eng.scheduler is None:
        return web.Response(status=503)
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
    sched = eng.scheduler
    before = sched.outputs
    (seq,) = eng.submit(GenerateRequest(items=[item], batch=False, stream=False))
    deadline = time.monotonic() + eng.cfg.health_generate_timeout_s
    while not seq.done.is_set() and sched.outputs == before:
        if time.monotonic() >= deadline:
            eng.abort_seqs([seq], "health check timed out")
            return web.Response(status=503)
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(seq.done.wait(), HEALTH_POLL_S)
    if not seq.done.is_set():  # others' output proved the scheduler alive: this one can go
        eng.abort_seqs([seq], "health check answered by other output")
        return web.Response(status=200)
    aborted = (seq.finish_reason or {}).get("type") == "abort"
    return web.Response(status=503 if aborted else 200)


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(engine_of(request).model_info())


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(engine_of(request).server_info())


async def get_load(request: web.Request) -> web.Response:
    return web.json_response([engine_of(request).load()])


async def v1_loads(request: web.Request) -> web.Response:
    return web.json_response({"loads": [engine_of(request).load()]})
