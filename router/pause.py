"""The fleet's abort-mode pause as the router holds it: no generate request is held anywhere.

Owns: `AbortPause` (one per router, shared by the control fan-out and the proxy),
`pause_mode`, `aborted_response`. SGLang's `/pause_generation {"mode": "abort"}` (the default
mode) aborts what its engine holds at that instant and then holds every request that reaches
it until `/continue_generation`. A request sent just before the pause (still in the client, in
the router, or read by the engine but not yet queued) is therefore held, not aborted, and a
caller that pauses in abort mode and waits for its requests to come back before it continues
(the data worker's `pause()`) waits forever. So, from a `/pause_generation` in abort mode until
the next `/continue_generation`, the router:

* answers every generate request it would forward (new, bound from its queue, re-dispatched
  after a preemption, retried) itself, aborted with no output (SGLang's shape: `meta_info.
  finish_reason {"type": "abort"}`; OpenAI routes: `finish_reason "abort"`; streamed ones as
  one such event and `[DONE]`), counted as `aborted_paused`;
* after the pause fan-out, aborts again (`/abort_request {"abort_all": true}`) on every engine
  that still holds a request the router forwarded, until none does (at most
  `control_timeout_s`): the requests that were on their way when the engines paused.

So once the pause reply comes, every generate request sent through the router before or during
the pause has been answered. An `in_place` or `retract` pause holds requests as SGLang does.
Must never import: `slime_async`, or the proxy/health/server modules.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

ABORT_MESSAGE = "Abort by pause_generation (router: the fleet is paused)"


def pause_mode(body: bytes) -> str:
    """The mode of a `/pause_generation` body (SGLang's default: `abort`)."""
    try:
        obj = json.loads(body) if body.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return "abort"  # the engines refuse the body; nothing is held either way
    mode = obj.get("mode", "abort") if isinstance(obj, dict) else "abort"
    return mode if isinstance(mode, str) else "abort"


class AbortPause:
    """Between a `/pause_generation` in abort mode and the next `/continue_generation`."""

    def __init__(self) -> None:
        self.active = False
        self.answered = 0
        """Generate requests the router answered aborted itself (`aborted_paused`)."""
        self._began = asyncio.Event()

    def begin(self) -> None:
        self.active = True
        self._began.set()

    def end(self) -> None:
        self.active = False
        self._began.clear()

    async def wait_begun(self) -> None:
        """Returns once an abort-mode pause is in effect (at once when it is)."""
        await self._began.wait()


def _generate_items(parsed: Any) -> list[dict]:
    """The items of a `/generate` body: a list of requests, a batch in one object (`text` a
    list, or `input_ids` a list of lists), or one request."""
    if isinstance(parsed, list):
        return [x if isinstance(x, dict) else {} for x in parsed]
    if not isinstance(parsed, dict):
        return [{}]
    text, ids = parsed.get("text"), parsed.get("input_ids")
    if isinstance(text, list):
        n = len(text)
    elif isinstance(ids, list) and ids and isinstance(ids[0], list):
        n = len(ids)
    else:
        return [parsed]
    rids = parsed.get("rid") if isinstance(parsed.get("rid"), list) else []
    batch_ids = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else []
    return [
        {
            "rid": rids[i] if i < len(rids) else None,
            "input_ids": batch_ids[i] if i < len(batch_ids) else None,
            "return_logprob": parsed.get("return_logprob"),
        }
        for i in range(n)
    ]


def _generate_item(req: dict) -> dict:
    rid = req.get("rid")
    meta: dict[str, Any] = {
        "id": rid if isinstance(rid, str) else None,
        "finish_reason": {"type": "abort", "message": ABORT_MESSAGE},
        "prompt_tokens": len(req["input_ids"]) if isinstance(req.get("input_ids"), list) else 0,
        "completion_tokens": 0,
    }
    if req.get("return_logprob"):
        meta["output_token_logprobs"] = []
        meta["input_token_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta}


def _openai_body(path: str, parsed: Any) -> dict:
    chat = path.endswith("/chat/completions")
    choice: dict[str, Any] = {"index": 0, "finish_reason": "abort", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": ""}
    else:
        choice["text"] = ""
    return {
        "id": "aborted",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": parsed.get("model") if isinstance(parsed, dict) else None,
        "choices": [choice],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


async def aborted_response(request: web.Request, path: str, body: bytes) -> web.StreamResponse:
    """The router's own answer to generate request `body` on `path` during an abort pause."""
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        parsed = {}
    if path == "/generate":
        items = [_generate_item(x) for x in _generate_items(parsed)]
        obj: Any = items if isinstance(parsed, list) or len(items) > 1 else items[0]
    else:
        obj = _openai_body(path, parsed)
    if not (isinstance(parsed, dict) and parsed.get("stream")):
        return web.json_response(obj)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for item in obj if isinstance(obj, list) else [obj]:
        await out.write(b"data: " + json.dumps(item).encode() + b"\n\n")
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out
