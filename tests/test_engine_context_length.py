"""Prompt + `max_new_tokens` over the context length, as SGLang answers it: a 400 naming both
numbers and the limit, unless the engine runs with `--allow-auto-truncate` (then the prompt is
cut to fit and `max_new_tokens` lowered to what is left). Real engines over HTTP."""

from __future__ import annotations

import aiohttp
import pytest
import torch

from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.testing import post

pytestmark = pytest.mark.timeout(120)
CTX = 32


def _serve(**kw):
    torch.set_num_threads(1)
    srv = EngineServer(EngineConfig(dtype="fp32", context_length=CTX, **kw))
    return srv, srv.start()


@pytest.fixture(scope="module")
def strict():
    srv, url = _serve()
    yield url
    srv.stop()


@pytest.fixture(scope="module")
def truncating():
    srv, url = _serve(allow_auto_truncate=True)
    yield url
    srv.stop()


def _body(n_prompt: int, max_new: int | None, **sp) -> dict:
    params = {"temperature": 0.0, "ignore_eos": True, **sp}
    if max_new is not None:
        params["max_new_tokens"] = max_new
    return {"input_ids": list(range(1, n_prompt + 1)), "sampling_params": params}


async def test_prompt_plus_max_new_tokens_over_context_is_a_400_naming_both(strict) -> None:
    async with aiohttp.ClientSession() as s:
        for max_new in (CTX - 10 + 1, 10**12):
            status, body = await post(s, strict + "/generate", _body(10, max_new))
            assert status == 400, body
            msg = body["error"]["message"]
            assert "10 prompt tokens" in msg and f"max_new_tokens {max_new}" in msg, msg
            assert f"context length of {CTX}" in msg and f"at most {CTX - 10}" in msg, msg
        # one bad item of a batch refuses the batch, naming the item; nothing is queued
        batch = {
            "input_ids": [[1, 2], list(range(1, 11))],
            "sampling_params": {"max_new_tokens": 30},
        }
        status, body = await post(s, strict + "/generate", batch)
        assert status == 400 and "input 1 asks" in body["error"]["message"], body
        # exactly the context length fits, and is generated in full
        status, ans = await post(s, strict + "/generate", _body(10, CTX - 10))
        assert status == 200 and len(ans["output_ids"]) == CTX - 10, ans
        # no max_new_tokens: SGLang checks only what the request sets
        status, ans = await post(s, strict + "/generate", _body(CTX - 1, None))
        assert status == 200 and len(ans["output_ids"]) == 1, ans
        # a prompt at the context length is refused as before
        status, body = await post(s, strict + "/generate", _body(CTX, 1))
        assert status == 400 and "context length" in body["error"]["message"], body


async def test_allow_auto_truncate_lowers_max_new_tokens_and_cuts_the_prompt(truncating) -> None:
    async with aiohttp.ClientSession() as s:
        status, ans = await post(s, truncating + "/generate", _body(10, 10**12, min_new_tokens=5))
        assert status == 200, ans
        assert len(ans["output_ids"]) == CTX - 10, ans
        assert ans["meta_info"]["finish_reason"]["type"] == "length"
        status, ans = await post(s, truncating + "/generate", _body(CTX + 8, 4))
        assert status == 200, ans
        assert ans["meta_info"]["prompt_tokens"] == CTX - 4, ans["meta_info"]
        assert len(ans["output_ids"]) == 4
        async with s.get(truncating + "/get_server_info") as r:
            assert (await r.json())["allow_auto_truncate"] is True
