"""The training gateway: OpenAI's `/v1/chat/completions` for agent code, token in, token out.

One responsibility, serving agents' chat calls as token-in-token-out model turns: owns
`TrainingGateway` (an aiohttp server on the rollout side; one URL per episode,
`<gateway>/episodes/<id>/v1`) and `GatewayStats`; what an episode sampled, turn by turn, is
`episode.py`'s `Episode`. Every chat call of an episode becomes one SGLang `/generate` call with
`input_ids` through the run's router (`X-Session-ID: <episode>`, so the turns of an episode stay
on the engine that caches its prefix), and the gateway records per turn the prompt ids, the
completion ids, their log-probs and weight versions. The rules (docs/agents.md):

* **Token in, token out.** Turn k+1 is rendered by the chat template (`contracts.chat`), and its
  prompt ids must begin with everything sampled so far (turn k's prompt + completion). When
  the template re-serialises an earlier turn differently (think blocks stripped, tool calls
  re-formatted, text that does not re-tokenize to the sampled ids), the gateway counts a
  **prefix mismatch** and keeps the sampled ids: the prompt becomes the sampled sequence plus
  the new messages' tokens (the template's tokens after the previous assistant turn). Trained
  tokens are always the sampled tokens.
* **Pinned sampling.** `temperature`, `top_p` and the per-turn token limit are the run's;
  an agent's different values are overridden, counted and logged (once per episode). Stop
  strings are the agent's (they end a turn, they do not change its distribution). `n` must be
  1 and `stream` false (an episode is one conversation of whole turns): 400 otherwise.
* **One trajectory.** `Episode.trajectory` is the first prompt, then every completion
  (loss mask 1, the engine's log-probs and per-token versions) and between them the new
  prompt tokens of each later turn (mask 0); a turn aborted by a weight update is continued
  from its partial output, so its tokens carry both versions. The data worker's prompt must be
  the start of the first prompt (else the episode fails: it could not be trained exactly).
* **Reward** per episode: `POST <episode url>/reward {"reward": x}` (AReaL's shape), the agent
  function's return value, or the run's reward function (docs/agents.md).

Calls to a closed or unknown episode are 404; bad input is 400 naming the problem; a turn the
engine refuses (its 4xx, e.g. a message that renders to ids outside the vocabulary) is that 4xx
with the engine's message, counted as a bad call; only an engine that is down or failing makes
a 503. The gateway binds 127.0.0.1 and requires its key on every route: the run's data-plane
key, or one it mints (`api_key`), which is all an agent ever holds (never the run's admin
key). Never imports the trainer, engine or controller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import secrets
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from aiohttp import web

from router.access import auth_middleware
from slime_async.contracts.chat import (
    ChatError,
    has_chat_template,
    normalize_messages,
    parse_tool_calls,
    render_after_last_assistant,
    render_chat,
    request_template_kwargs,
    request_tools,
    tool_names,
)
from slime_async.contracts.rollout import FinishStatus, segment_payload
from slime_async.rollout.agents.episode import Episode, GatewayError, Sampled
from slime_async.rollout.generate.client import GenerateClient, GenerateError

log = logging.getLogger(__name__)
_MAX_BODY = 16 << 20
RESUME_WAIT_S = (0.02, 1.0)
"""After an aborted call that brought no new token (the fleet is paused for a weight update:
the router answers every call aborted until it continues), the next call waits this long,
doubling up to the second value; a call that brought tokens resets it."""
RESUME_BUDGET_S = 600.0
"""A turn stops being continued (it ends aborted) after this long without a finished call:
longer than any weight update's pause (`--update-weight-timeout`)."""
_SEARCH_AHEAD = 4
"""How far into the tokens after a re-rendered assistant turn its sampled closing token (EOS)
is looked for."""


@dataclasses.dataclass(slots=True)
class GatewayStats:
    """Counters over all episodes (the run logs them as `agent/*`)."""

    episodes: int = 0
    turns: int = 0
    prefix_mismatches: int = 0
    """Turns whose rendered prompt did not begin with the sampled ids (sampled ids kept)."""
    sampling_overrides: int = 0
    """Calls whose temperature / top_p / token limit differed from the run's (overridden)."""
    resumed_turns: int = 0
    """Turns aborted by a weight update and continued from their partial output."""
    resumed_calls: int = 0
    """The calls those continuations took (several while the fleet stays paused)."""
    bad_calls: int = 0
    """Calls refused with 4xx (the gateway's own refusals and the engine's)."""


def _assistant_count(messages: list[dict[str, Any]]) -> int:
    return sum(m["role"] == "assistant" for m in messages)


class TrainingGateway:
    """The gateway server: `await start()` on the rollout's event loop, then `open_episode`,
    hand the agent `episode_url(ep)`, `close_episode` when it returns."""

    def __init__(
        self,
        *,
        tokenizer: Any,
        eos_id: int | None,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """`template_kwargs`: the chat template's keyword arguments the data prompts were
        rendered with (--apply-chat-template-kwargs); a request's own `chat_template_kwargs`
        go over them."""
        self.tokenizer, self.eos_id = tokenizer, eos_id
        self.template_kwargs = dict(template_kwargs or {})
        self.api_key = api_key or secrets.token_urlsafe(32)
        """What every route needs (`Authorization: Bearer`): the agents' only credential."""
        self.host, self.port = host, port
        self.stats = GatewayStats()
        self.episodes: dict[str, Episode] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._started: asyncio.Future[str] | None = None
        self.turn_overhead_s: list[float] = []
        """Per turn: time spent in the gateway itself (rendering, checks, assembly), without
        the `/generate` call; the last 10 000 turns."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Bind and return the base URL (once; concurrent callers wait for the first)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._started)

    async def _start(self) -> str:
        auth = auth_middleware("gateway", api_key=self.api_key, admin_api_key=None, refuse=_refuse)
        app = web.Application(client_max_size=_MAX_BODY, middlewares=[auth])
        app.router.add_post("/episodes/{eid}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{eid}/v1/models", self._models)
        app.router.add_post("/episodes/{eid}/reward", self._reward)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.url = f"http://{self.host}:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._started is not None:
            await asyncio.gather(self._started, return_exceptions=True)
            self._started = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_episode(
        self,
        client: GenerateClient,
        *,
        data_prompt: Sequence[int] = (),
        max_turn_tokens: int | None = None,
    ) -> Episode:
        """A new episode sampling with `client`'s settings; its budget is the client's
        `max_response_len` over all turns."""
        ep = Episode(
            id=uuid.uuid4().hex,
            client=client,
            data_prompt=tuple(int(t) for t in data_prompt),
            budget=client.cfg.max_response_len,
            max_turn_tokens=max_turn_tokens,
        )
        self.episodes[ep.id] = ep
        self.stats.episodes += 1
        return ep

    def close_episode(self, ep: Episode) -> Episode:
        """No further calls are accepted (a timed-out agent's next call gets 404)."""
        ep.closed = True
        self.episodes.pop(ep.id, None)
        return ep

    def episode_url(self, ep: Episode) -> str:
        """The OpenAI `base_url` of the episode."""
        return f"{self.url}/episodes/{ep.id}/v1"

    def reward_url(self, ep: Episode) -> str:
        """Where the episode's reward may be posted."""
        return f"{self.url}/episodes/{ep.id}/reward"

    # ------------------------------------------------------------------ HTTP
    def _episode(self, request: web.Request) -> Episode:
        ep = self.episodes.get(request.match_info["eid"])
        if ep is None or ep.closed:
            raise GatewayError(
                "no open episode with this id (it ended or timed out); an episode's URL is "
                "valid only while its agent function runs",
                status=404,
            )
        return ep

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise GatewayError(f"body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise GatewayError("body must be a JSON object")
        return body

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            ep = self._episode(request)
            return web.json_response(await self.chat(ep, await self._json(request)))
        except (GatewayError, ChatError) as e:
            self.stats.bad_calls += 1
            return _error(getattr(e, "status", 400), str(e))
        except GenerateError as e:  # the engine's answer to this turn
            if e.status is not None and 400 <= e.status < 500:
                self.stats.bad_calls += 1
                return _error(e.status, f"the engine refused this turn: {e}")
            return _error(503, f"the engine could not serve this turn (down or failing): {e}")

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._episode(request)
        except GatewayError as e:
            return _error(e.status, str(e))
        card = {"id": "policy", "object": "model", "created": 0, "owned_by": "slime-async"}
        return web.json_response({"object": "list", "data": [card]})

    async def _reward(self, request: web.Request) -> web.Response:
        try:
            ep = self._episode(request)
            v = (await self._json(request)).get("reward")
            if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v):
                raise GatewayError('reward must be a finite number: {"reward": 1.0}')
        except GatewayError as e:
            return _error(e.status, str(e))
        ep.reward = float(v)
        return web.json_response({"episode": ep.id, "reward": ep.reward})

    # ------------------------------------------------------------------ one turn
    def _pin(self, ep: Episode, body: dict[str, Any]) -> None:
        """Count (and log once per episode) the agent's sampling values the run overrides."""
        cfg = ep.client.cfg
        asked = {
            "temperature": (body.get("temperature"), cfg.temperature),
            "top_p": (body.get("top_p"), cfg.top_p),
        }
        if ep.max_turn_tokens is not None:
            asked["max_tokens"] = (
                body.get("max_completion_tokens", body.get("max_tokens")),
                ep.max_turn_tokens,
            )
        diff = {k: v for k, (v, run) in asked.items() if v is not None and v != run}
        if diff:
            self.stats.sampling_overrides += 1
            ep.overrides += 1
            if ep.overrides == 1:
                log.info(
                    "agent episode %s asked for %s; the run's sampling is pinned (temperature "
                    "%g, top_p %g, %d tokens per turn)",
                    ep.id,
                    diff,
                    cfg.temperature,
                    cfg.top_p,
                    cfg.max_response_len,
                )

    def _prompt(
        self,
        ep: Episode,
        messages: list[dict[str, Any]],
        tools: Any,
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], bool]:
        """This turn's prompt ids under the token-in-token-out rule, and whether the rendered
        conversation mismatched what was sampled (`kwargs`: the chat template's; default the
        run's)."""
        kwargs = self.template_kwargs if kwargs is None else kwargs
        full = render_chat(
            self.tokenizer, messages, tools=tools, eos_id=self.eos_id, template_kwargs=kwargs
        )
        if not ep.turns:
            if full[: len(ep.data_prompt)] != list(ep.data_prompt):
                raise GatewayError(
                    "the first request does not begin with the data prompt: the episode could "
                    "not be trained on exactly what was sampled. Send the sample's messages "
                    "first (sample['messages']), with the same system prompt and tools the "
                    "data was rendered with"
                )
            return full, False
        n_asst = _assistant_count(messages)
        if n_asst != len(ep.turns):
            raise GatewayError(
                f"the conversation has {n_asst} assistant messages but the episode has "
                f"{len(ep.turns)} model turns: an episode is one growing conversation (send "
                "every earlier assistant message back, unchanged or not, and nothing else)"
            )
        prev = ep.ids
        if full[: len(prev)] == prev:
            return full, False
        ep.prefix_mismatches += 1
        self.stats.prefix_mismatches += 1
        tail = render_after_last_assistant(
            self.tokenizer, messages, tools=tools, eos_id=self.eos_id, template_kwargs=kwargs
        )
        last = ep.turns[-1].output_ids[-1:]
        # the previous turn's closing token (EOS) was sampled: it is already in `prev`
        for j, t in enumerate(tail[:_SEARCH_AHEAD]):
            if last and t == last[0]:
                tail = tail[j + 1 :]
                break
        return prev + tail, True

    async def chat(self, ep: Episode, body: dict[str, Any]) -> dict[str, Any]:
        """One `/v1/chat/completions` call of `ep`: the OpenAI answer (raises `GatewayError`)."""
        t0 = time.perf_counter()
        messages, tools, stop = self._parse_call(body)
        self._pin(ep, body)
        kwargs = {**self.template_kwargs, **request_template_kwargs(body)}
        prompt, mismatch = self._prompt(ep, messages, tools, kwargs)
        used = max(0, len(prompt) - len(ep.data_prompt))
        n = ep.budget - used
        if ep.max_turn_tokens is not None:
            n = min(n, ep.max_turn_tokens)
        overhead = time.perf_counter() - t0
        if n <= 0:
            sampled = Sampled(finish="length")
        else:
            sampled = await self._generate(ep, prompt, n, stop)
        t1 = time.perf_counter()
        ep.record(prompt, sampled, mismatch=mismatch)
        self.stats.turns += 1
        answer = _answer(
            ep, prompt, sampled, mismatch=mismatch, tools=tool_names(tools) if tools else None
        )
        overhead += time.perf_counter() - t1
        self.turn_overhead_s.append(overhead)
        if len(self.turn_overhead_s) > 10_000:
            del self.turn_overhead_s[:5_000]
        return answer

    def _parse_call(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any, list[str]]:
        """The call's messages, tools and stop strings; `GatewayError` for what an episode
        cannot take (n > 1, streaming, tools without a chat template, bad stop strings)."""
        if body.get("n", 1) != 1:
            raise GatewayError("n must be 1 in a training episode (one conversation)")
        if body.get("stream"):
            raise GatewayError("the training gateway answers whole turns; set stream=False")
        messages = normalize_messages(body.get("messages"))
        tools = request_tools(body)
        if tools and not has_chat_template(self.tokenizer):
            raise GatewayError("this model has no chat template, so it cannot be given tools")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise GatewayError("stop must be a non-empty string or a list of them")
        return messages, tools, stop

    async def _generate(self, ep: Episode, prompt: list[int], n: int, stop: list[str]) -> Sampled:
        """One model turn through the router; a turn aborted by a weight update is continued
        from its partial output (its tokens keep the versions that produced them), waiting out
        a pause (`RESUME_WAIT_S`) instead of calling again at once."""
        client = ep.client
        got = Sampled()
        data: dict[str, Any] = {}
        turn = len(ep.turns)
        loop = asyncio.get_running_loop()
        deadline, wait = loop.time() + RESUME_BUDGET_S, RESUME_WAIT_S[0]
        for attempt in itertools.count():
            left = n - len(got.output_ids)
            body = _generate_body(
                client, prompt + got.output_ids, left, stop, rid=f"{ep.id}-t{turn}-a{attempt}"
            )
            headers = {"X-Expected-Tokens": str(left), "X-Session-ID": ep.id}
            data = await client.post(body, headers)
            res = client.parse_response(data, prompt_len=len(body["input_ids"]))
            pay = segment_payload(res.payload)
            got.output_ids += res.output_ids
            got.logprobs += pay["logprobs"]
            got.nonfinite += pay["nonfinite"]
            got.versions += list(res.token_versions)
            got.routed = pay.get("routed_experts", got.routed)
            got.finish = pay.get("finish")
            if res.status is not FinishStatus.ABORTED or len(got.output_ids) >= n:
                break
            if attempt == 0:
                self.stats.resumed_turns += 1
            self.stats.resumed_calls += 1
            wait = RESUME_WAIT_S[0] if res.output_ids else wait
            if loop.time() + wait > deadline:
                log.warning(
                    "turn %d of episode %s: still aborted after %.0fs", turn, ep.id, RESUME_BUDGET_S
                )
                break
            await asyncio.sleep(wait)
            wait = min(2 * wait, RESUME_WAIT_S[1])
        matched = ((data.get("meta_info") or {}).get("finish_reason") or {}).get("matched")
        got.text = self._completion_text(got.output_ids, got.finish, matched)
        return got

    def _completion_text(self, out: list[int], finish: str | None, matched: Any) -> str:
        """The sampled ids decoded with special tokens kept (so that it encodes back to them),
        without the stop token, cut at a matched stop string."""
        ids = out[:-1] if finish == "stop" and isinstance(matched, int) else out
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text


def _generate_body(
    client: GenerateClient, input_ids: list[int], left: int, stop: list[str], *, rid: str
) -> dict[str, Any]:
    """The SGLang `/generate` body of one call of a turn: the run's pinned sampling, the
    agent's stop strings after the run's, at most `left` new tokens."""
    cfg = client.cfg
    sp: dict[str, Any] = {
        "max_new_tokens": left,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
    }
    if cfg.stop_token_ids:
        sp["stop_token_ids"] = list(cfg.stop_token_ids)
    if stop or cfg.stop:
        sp["stop"] = [*cfg.stop, *stop]
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sp,
        "return_logprob": True,
        "rid": rid,
    }
    if cfg.return_routed_experts:
        body["return_routed_experts"] = True
    return body


def _answer(
    ep: Episode,
    prompt: list[int],
    sampled: Sampled,
    *,
    mismatch: bool,
    tools: frozenset[str] | None,
) -> dict[str, Any]:
    """The OpenAI chat-completion answer of the turn just recorded (tool calls parsed from
    the text, in the model family's format, when the call offered `tools`: their names)."""
    out, finish = sampled.output_ids, sampled.finish
    text = sampled.text
    content, calls = parse_tool_calls(text, tools=tools) if tools is not None else (text, [])
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    reason = "tool_calls" if calls and finish == "stop" else (finish or "stop")
    return {
        "id": f"chatcmpl-{ep.id}-{len(ep.turns)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "policy",
        "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": reason}],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out),
            "total_tokens": len(prompt) + len(out),
        },
        "meta_info": {
            "output_ids": out,
            "weight_versions": sampled.versions,
            "prefix_mismatch": mismatch,
        },
    }


def _refuse(_request: web.Request, status: int, message: str) -> web.Response:
    return _error(status, f"{message} (an agent's client gets it as its api_key)")


def _error(status: int, message: str) -> web.Response:
    err = {"message": message, "type": "invalid_request_error", "code": status}
    return web.json_response({"error": err}, status=status)
