"""Tool calls in each supported family's format become OpenAI `tool_calls`: Hermes/Qwen
`<tool_call>` blocks, Mistral's `[TOOL_CALLS]` (a JSON list, or `name[ARGS]{...}`), Llama 3.x's
`<|python_tag|>` JSON; a completion whose special tokens were decoded away is still read when it
is only calls of the request's tools, and plain text or plain JSON is never taken for a call.
The last test runs the training gateway on completions in each format (an agent written with
the `openai` client gets the calls parsed)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from slime_async.contracts.chat import parse_tool_calls, tool_names

ADD = {"name": "add", "arguments": {"a": 2, "b": 3}}
WANT = [("add", {"a": 2, "b": 3})]


def _calls(text: str, tools=("add", "mul")) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse_tool_calls(text, tools=frozenset(tools) if tools else None)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    for c in calls:
        assert c["type"] == "function" and c["id"]
    return content, got


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f"let me add <tool_call>{json.dumps(ADD)}</tool_call>", "let me add", WANT),
        (f"[TOOL_CALLS] [{json.dumps(ADD)}, {{'x': 1}}]", "[TOOL_CALLS] [", []),  # not JSON
        (f"sure[TOOL_CALLS][{json.dumps(ADD)}]", "sure", WANT),
        ('[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}[TOOL_CALLS]mul[ARGS]{"a": 1}', "",
         [*WANT, ("mul", {"a": 1})]),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}', "", WANT),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}; {"name": "mul", '
         '"parameters": {"a": ";"}}', "", [*WANT, ("mul", {"a": ";"})]),
        # the markers decoded away: read only as calls of the request's tools
        ('{"name": "add", "parameters": {"a": 2, "b": 3}}', "", WANT),
        (f"[{json.dumps(ADD)}]", "", WANT),
        ('{"name": "search", "parameters": {}}', '{"name": "search", "parameters": {}}', []),
        ('{"answer": 5}', '{"answer": 5}', []),
        ("The answer is 5.", "The answer is 5.", []),
    ],
)  # fmt: skip
def test_each_format_parses_and_anything_else_stays_content(text, content, calls):
    got_content, got_calls = _calls(text)
    assert got_calls == calls
    if calls:
        assert got_content == content
    else:
        assert got_content == text  # untouched


def test_marker_less_json_needs_the_request_tools_and_mistral_ids_fit_its_template():
    assert _calls('{"name": "add", "parameters": {}}', tools=None)[1] == []
    _, calls = parse_tool_calls(f"[TOOL_CALLS][{json.dumps(ADD)}]", tools=None)
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()  # Mistral's rule
    assert tool_names([{"type": "function", "function": {"name": "add"}}, {"name": "mul"}]) == {
        "add",
        "mul",
    }


MARKERS = ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>")


@pytest.fixture(scope="module")
def tok():
    from slime_async.engine.testing import QWEN_STYLE_TEMPLATE, ascii_chat_tokenizer

    t = ascii_chat_tokenizer(QWEN_STYLE_TEMPLATE)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *MARKERS]})
    return t


async def _fixed_engine(port: int, ids: list[int], eos: int) -> web.AppRunner:
    """An SGLang `/generate` that always answers `ids` then EOS (a scripted model)."""

    async def generate(request: web.Request) -> web.Response:
        await request.json()
        out = [*ids, eos]
        meta = {
            "finish_reason": {"type": "stop", "matched": eos},
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, t, None] for t in out],
        }
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.mark.parametrize(
    "completion",
    [
        f"[TOOL_CALLS][{json.dumps(ADD)}]",
        '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}',
        '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}',
    ],
)
async def test_the_training_gateway_parses_mistral_and_llama_calls(
    tok, completion, unused_tcp_port
):
    openai = pytest.importorskip("openai")
    from slime_async.contracts.rollout import GenerationRequest, Prompt
    from slime_async.rollout.agents.agent import AgentGenerate
    from slime_async.rollout.agents.gateway import TrainingGateway
    from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig

    eos = tok.eos_token_id
    runner = await _fixed_engine(unused_tcp_port, tok.encode(completion), eos)
    client = GenerateClient(
        GenerateClientConfig(url=f"http://127.0.0.1:{unused_tcp_port}", max_response_len=200)
    )
    gw = TrainingGateway(tokenizer=tok, eos_id=eos)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    seen = []

    def agent(c: openai.OpenAI, sample) -> float:
        r = c.chat.completions.create(model="m", messages=list(sample.messages), tools=tools)
        seen.append(r.choices[0])
        return 1.0

    gen = AgentGenerate(agent, client, gw, timeout_s=60, decode=tok.decode)
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    ids = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"]
    req = GenerationRequest(
        prompt=Prompt(key="q", prompt_ids=ids, payload={"metadata": {"messages": msgs}}),
        group_seq=0,
        sample_index=0,
    )
    try:
        await asyncio.wait_for(gen.episode(req), 60)
    finally:
        await gw.stop()
        await client.close()
        await runner.cleanup()
    (choice,) = seen
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
