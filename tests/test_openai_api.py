"""The OpenAI-compatible routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) of the
embedded engine, called with the `openai` package's client through the router, and the
router's session affinity (`X-Session-ID`)."""

from __future__ import annotations

import asyncio

import pytest

from router import Router, RouterConfig

openai = pytest.importorskip("openai")
engine_mod = pytest.importorskip("slime_async.engine")
pytestmark = pytest.mark.timeout(300)

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def chat_engines(tmp_path_factory):
    import torch

    from slime_async.engine.testing import THINKING_SWITCH_TEMPLATE, chat_model_dir

    torch.set_num_threads(1)  # ChatML; with enable_thinking=False, an empty think block
    d = chat_model_dir(
        str(tmp_path_factory.mktemp("chat") / "m"), template=THINKING_SWITCH_TEMPLATE
    )
    cfg = engine_mod.EngineConfig(
        num_threads=1, model_dir=d, dtype="fp32", api_key=TOKEN, weight_version="0"
    )
    servers = [engine_mod.EngineServer(cfg) for _ in range(2)]
    try:
        yield [s.start() for s in servers], d
    finally:
        for s in servers:
            s.stop()


@pytest.fixture()
async def router_url(chat_engines):
    urls, _ = chat_engines
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=0.2, api_key=TOKEN))
    url = await router.start()
    try:
        yield url, router
    finally:
        await router.stop()


def _client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=60, **kw)


async def test_openai_client_chat_through_router(chat_engines, router_url) -> None:
    url, _ = router_url
    _, model_dir = chat_engines
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "what is 2 + 3?"}]

    def call():
        c = _client(url)
        models = c.models.list()
        r = c.chat.completions.create(
            model=models.data[0].id,
            messages=messages,
            max_tokens=12,
            temperature=0.0,
            logprobs=True,
            n=2,
        )
        s = c.chat.completions.create(
            model="any", messages=messages, max_tokens=12, temperature=0.0, stream=True
        )
        streamed = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
        cmp = c.completions.create(model="any", prompt="2 + 3 =", max_tokens=5, logprobs=1)
        return models, r, streamed, cmp

    models, r, streamed, cmp = await asyncio.to_thread(call)
    assert models.data[0].max_model_len > 0
    assert len(r.choices) == 2 and r.choices[0].message.role == "assistant"
    meta = r.model_extra["meta_info"]
    assert meta["weight_version"] == "0"
    for ch, ids in zip(r.choices, meta["output_ids"]):
        assert [t.logprob for t in ch.logprobs.content] and len(ch.logprobs.content) == len(ids)
        assert all(t.logprob <= 0 for t in ch.logprobs.content)
        assert ch.finish_reason in ("stop", "length")
        assert ch.message.content == tok.decode(
            ids[:-1] if ch.finish_reason == "stop" else ids, skip_special_tokens=True
        )
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: same twice
    assert streamed == r.choices[0].message.content
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert r.usage.prompt_tokens == len(prompt["input_ids"])
    assert len(cmp.choices[0].logprobs.token_logprobs) == cmp.usage.completion_tokens


async def test_bad_requests_are_400_and_auth_is_required(chat_engines, router_url) -> None:
    url, _ = router_url
    urls, _ = chat_engines

    def call():
        errors = []
        for kw in (
            {"messages": [{"role": "wizard", "content": "x"}]},
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3, "logprobs": True},
            {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1.0},
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        ):
            with pytest.raises(openai.BadRequestError) as e:
                _client(url).chat.completions.create(model="m", **kw)
            errors.append(str(e.value))
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=urls[0] + "/v1", api_key="wrong", max_retries=0).models.list()
        return errors

    errors = await asyncio.to_thread(call)
    assert "wizard" in errors[0] and "top_logprobs" in errors[1]
    assert "presence_penalty" in errors[2] and "max_new_tokens" in errors[3]


async def test_chat_template_kwargs_reach_the_template(chat_engines, router_url) -> None:
    """SGLang's `chat_template_kwargs` (Qwen3's thinking switch): the prompt is rendered with
    them; a key the server sets itself is a 400."""
    url, _ = router_url
    _, model_dir = chat_engines
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "2+3?"}]

    def call(extra: dict) -> int:
        r = _client(url).chat.completions.create(
            model="m", messages=messages, max_tokens=1, extra_body=extra
        )
        return r.usage.prompt_tokens

    plain = await asyncio.to_thread(call, {})
    off = await asyncio.to_thread(call, {"chat_template_kwargs": {"enable_thinking": False}})
    want = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert off == len(want["input_ids"]) > plain
    with pytest.raises(openai.BadRequestError, match="cannot set"):
        await asyncio.to_thread(call, {"chat_template_kwargs": {"tokenize": False}})


async def test_session_affinity_keeps_a_conversation_on_one_engine(router_url) -> None:
    url, router = router_url
    await asyncio.sleep(0)
    for _ in range(100):  # both engines admitted
        if len(router.registry.healthy()) == 2:
            break
        await asyncio.sleep(0.05)

    def call(session: str) -> None:
        c = _client(url, default_headers={"X-Session-ID": session})
        for _ in range(3):
            c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )

    sessions = [f"episode-{i}" for i in range(8)]
    for s in sessions:
        before = {w.url: w.total_requests for w in router.registry.all()}
        await asyncio.to_thread(call, s)
        served = {w.url for w in router.registry.all() if w.total_requests > before[w.url]}
        assert len(served) == 1, (s, served)  # every turn of the session on one engine
    counts = [w.total_requests for w in router.registry.all()]
    assert all(c > 0 for c in counts)  # and sessions spread over both
    assert router.proxy.affinity.affine == router.proxy.affinity.session_requests == 24
