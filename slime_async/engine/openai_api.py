"""OpenAI-compatible routes of the embedded engine: `/v1/chat/completions`, `/v1/completions`,
`/v1/models` (what `openai.OpenAI(base_url=<engine or router>/v1)` calls).

Owns: `add_openai_routes(app)` and the translation both ways. A chat request is rendered to
prompt ids by the tokenizer's chat template (`slime_async.contracts.chat.render_chat`, `tools`
passed to the template), then becomes a `/generate` request (`parse_generate`: the same
validation, limits and scheduler, the model lock held as a reader); the answer becomes OpenAI's
shape: `choices[i].message` (tool calls in the Hermes/Qwen, Mistral or Llama 3.x format parsed
into `tool_calls`),
`logprobs.content` when `logprobs: true`, `finish_reason`, `usage`, and `meta_info`
(`weight_version`, the sampled `output_ids` of each choice: token in, token out).
OpenAI keys: `model` (any; the served model answers), `messages`/`prompt`, `tools`,
`tool_choice` ("none" drops the tools, others leave the choice to the model), image content
parts (`image_url` with a data URI; vision-language models only, `contracts.chat.take_images`),
`chat_template_kwargs` (SGLang's: keyword arguments of the chat template, e.g.
`{"enable_thinking": false}`), `n`,
`max_tokens`/`max_completion_tokens`, `temperature`, `top_p`, `stop`, `seed`, `logprobs`,
`stream` (the answer as one content chunk once finished, then `[DONE]`). Refused (400, naming
the key): `top_logprobs` > 0, penalties and `logit_bias` (through `parse_sampling_params`).
Auth and body limits are the server's middleware (every route the same). Must never import
torch model code.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from typing import Any

from aiohttp import web

from slime_async.contracts.chat import (
    ChatError,
    normalize_messages,
    parse_tool_calls,
    render_chat,
    request_template_kwargs,
    request_tools,
    take_images,
    tool_names,
)
from slime_async.engine.engine import Engine, EngineState
from slime_async.engine.http_common import client_gone, error
from slime_async.engine.protocol import parse_generate, response_item
from slime_async.engine.sampling import RequestError
from slime_async.engine.sequence import Sequence, wait_done
from slime_async.engine.vision import with_images

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")
"""Generation routes whose bodies may be as large as `/generate`'s."""


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError("body nests JSON too deeply to parse; send a flat request") from None
    if not isinstance(body, dict):
        raise RequestError(f"{request.path} body must be a JSON object")
    return body


def sampling_from_openai(body: dict[str, Any]) -> dict[str, Any]:
    """SGLang `sampling_params` of an OpenAI body (values are checked by the engine's parser)."""
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise RequestError("top_logprobs is not supported by the embedded engine; leave it unset")
    sp: dict[str, Any] = {}
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None:
        sp["max_new_tokens"] = mt
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("n", "n"),
        ("sampling_seed", "seed"),
        ("frequency_penalty", "frequency_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("logit_bias", "logit_bias"),
    ):
        if body.get(theirs) is not None:
            sp[ours] = body[theirs]
    stop = body.get("stop")
    if stop:
        sp["stop"] = [stop] if isinstance(stop, str) else stop
    return sp


def _finish(seq: Sequence, *, tool_calls: bool = False) -> str:
    kind = (seq.finish_reason or {}).get("type", "stop")
    if kind == "stop" and tool_calls:
        return "tool_calls"
    return str(kind)


async def _run(
    request: web.Request,
    eng: Engine,
    ids_list: list[list[int]],
    sp: dict[str, Any],
    images: list[str] | None = None,
) -> list[Sequence] | web.Response:
    """Generate for each prompt (n samples each, `images` with a single prompt); the finished
    sequences, or an error answer."""
    assert eng.lm is not None
    body = {
        "input_ids": ids_list if len(ids_list) > 1 else ids_list[0],
        "sampling_params": sp,
        "return_logprob": True,
        "image_data": images or None,
    }
    req = parse_generate(body, tokenizer=eng.lm.tokenizer, limits=eng.limits)
    if eng.lm.vision is not None:
        req = await asyncio.to_thread(with_images, req, eng)
    async with eng.model_lock.reader():
        if eng.memory.sleeping:
            return error(eng.memory.why_asleep(), status=503)
        seqs = eng.submit(req)
        if not await wait_done(seqs, lambda: client_gone(request)):
            eng.abort_seqs(seqs, "client disconnected")
            return web.Response(status=499)
    for s in seqs:
        code = (s.finish_reason or {}).get("status_code")
        if code is not None and code >= 400:
            return error(s.finish_reason["message"], status=code)  # type: ignore[index]
    return seqs


def _placeholder(eng: Engine) -> str | None:
    """The text of one image in a rendered chat (`<|vision_start|><|image_pad|><|vision_end|>`
    through the tokenizer; the engine expands the pad), None for a text model."""
    v = eng.lm.vision if eng.lm is not None else None
    if v is None:
        return None
    ids = [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id]
    text = eng.lm.tokenizer.decode(ids, skip_special_tokens=False)
    return text if eng.lm.has_tokenizer else f" {text} "  # the id codec's words need spaces


def _usage(seqs: list[Sequence], prompts: list[list[int]]) -> dict[str, int]:
    p = sum(len(ids) for ids in prompts)
    c = sum(len(s.output) for s in seqs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _metadata(seqs: list[Sequence]) -> dict[str, Any]:
    return {
        "weight_version": seqs[-1].version_spans[-1][0],
        "output_ids": [list(s.output) for s in seqs],
        "weight_versions": [s.version_span_dicts() for s in seqs],
    }


def _chat_choice(
    i: int, s: Sequence, tok: Any, *, tools: frozenset[str] | None, logprobs: bool
) -> dict[str, Any]:
    """OpenAI's `choices[i]` of one finished sample: the message (with `tool_calls` parsed
    out, in the model family's format, when the request named `tools`; from the text with its
    special tokens, which mark Mistral's and Llama's calls), `logprobs.content` when asked,
    `finish_reason`."""
    text = response_item(s, tokenizer=tok)["text"]
    content, calls = text, []
    if tools is not None:
        raw = response_item(s, tokenizer=tok, skip_special_tokens=False)["text"]
        content, calls = parse_tool_calls(raw, tools=tools)
        content = content if calls else text
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    lp = None
    if logprobs:
        lp = {
            "content": [
                {
                    "token": tok.decode([t]),
                    "logprob": v,
                    "bytes": list(tok.decode([t]).encode()),
                    "top_logprobs": [],
                }
                for t, v in zip(s.output, s.output_logprobs)
            ]
        }
    return {
        "index": i,
        "message": msg,
        "logprobs": lp,
        "finish_reason": _finish(s, tool_calls=bool(calls)),
    }


async def chat_completions(eng: Engine, request: web.Request) -> web.StreamResponse:
    if eng.state is not EngineState.SERVING:
        return error("engine is not serving (starting or shutting down)", status=503)
    assert eng.lm is not None
    tok = eng.lm.tokenizer
    try:
        body = await _body(request)
        raw, images = take_images(body.get("messages"), _placeholder(eng))
        messages = normalize_messages(raw)
        tools = request_tools(body)
        eos = min(eng.lm.eos_token_ids) if eng.lm.eos_token_ids else None
        kwargs = request_template_kwargs(body)
        ids = render_chat(tok, messages, tools=tools, eos_id=eos, template_kwargs=kwargs)
        sp = sampling_from_openai(body)
        want_lp = body.get("logprobs") or False
        if not isinstance(want_lp, bool):
            raise RequestError("logprobs must be true or false")
        stream = body.get("stream") or False
        got = await _run(request, eng, [ids], sp, images)
    except (RequestError, ChatError) as e:
        return error(str(e))
    if isinstance(got, web.Response):
        return got
    seqs = got
    choices = [
        _chat_choice(i, s, tok, tools=tool_names(tools) if tools else None, logprobs=want_lp)
        for i, s in enumerate(seqs)
    ]
    out = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": eng.served_model_name(),
        "choices": choices,
        "usage": _usage(seqs, [seqs[0].prompt]),
        "meta_info": _metadata(seqs),
    }
    if stream:
        return await _as_stream(request, out)
    return web.json_response(out)


async def _as_stream(request: web.Request, out: dict[str, Any]) -> web.StreamResponse:
    """A finished chat answer as OpenAI's chunk stream: one delta per choice, a final chunk."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    base = {k: out[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for c in out["choices"]:
        delta = dict(c["message"])
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": j, **tc} for j, tc in enumerate(delta["tool_calls"])]
        chunk = {
            **base,
            "choices": [
                {
                    "index": c["index"],
                    "delta": delta,
                    "logprobs": c["logprobs"],
                    "finish_reason": None,
                }
            ],
        }
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        end = {
            **base,
            "choices": [{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}],
        }
        await resp.write(f"data: {json.dumps(end)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _prompts(prompt: Any, tok: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tok.encode(p) for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]
    raise RequestError("prompt must be a string, a list of strings, token ids or lists of ids")


async def completions(eng: Engine, request: web.Request) -> web.StreamResponse:
    if eng.state is not EngineState.SERVING:
        return error("engine is not serving (starting or shutting down)", status=503)
    assert eng.lm is not None
    tok = eng.lm.tokenizer
    try:
        body = await _body(request)
        if body.get("stream"):
            raise RequestError("stream is not supported on /v1/completions; leave it unset")
        want_lp = body.get("logprobs")
        if want_lp not in (None, 0, 1, True, False):
            raise RequestError("logprobs > 1 (top alternatives) is not supported; send 0 or 1")
        try:
            prompts = _prompts(body.get("prompt"), tok)
        except ValueError as e:
            raise RequestError(str(e)) from None
        got = await _run(request, eng, prompts, sampling_from_openai(body))
    except RequestError as e:
        return error(str(e))
    if isinstance(got, web.Response):
        return got
    choices = []
    for i, s in enumerate(got):
        item: dict[str, Any] = {
            "index": i,
            "text": response_item(s, tokenizer=tok)["text"],
            "logprobs": None,
            "finish_reason": _finish(s),
        }
        if want_lp:
            item["logprobs"] = {
                "tokens": [tok.decode([t]) for t in s.output],
                "token_logprobs": list(s.output_logprobs),
                "top_logprobs": None,
                "text_offset": None,
            }
        choices.append(item)
    return web.json_response(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": eng.served_model_name(),
            "choices": choices,
            "usage": _usage(got, prompts),
            "meta_info": _metadata(got),
        }
    )


async def models(eng: Engine, request: web.Request) -> web.Response:
    assert eng.lm is not None
    name = eng.served_model_name()
    card = {
        "id": name,
        "object": "model",
        "created": int(eng.startup_time),
        "owned_by": "slime-async",
        "root": eng.lm.model_path,
        "max_model_len": eng.lm.context_length,
    }
    return web.json_response({"object": "list", "data": [card]})


def add_openai_routes(app: web.Application, engine: Engine) -> None:
    """Register the `/v1/*` OpenAI routes of `engine` on its app."""
    app.router.add_post("/v1/chat/completions", functools.partial(chat_completions, engine))
    app.router.add_post("/v1/completions", functools.partial(completions, engine))
    app.router.add_get("/v1/models", functools.partial(models, engine))
