"""Two embedded engines behind the real `sglang-router` binary (PyPI sglang-router 0.3.2):
the router registers them (probing /health, /get_model_info, /get_server_info) and
/generate requests flow through it with SGLang's response shape intact."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from slime_async.contracts.rollout import decode_routed_experts
from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.testing import post, stock_sglang_router

pytestmark = pytest.mark.timeout(120)
sglang_router = pytest.importorskip("sglang_router", reason="sglang-router wheel not installed")


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    servers = [
        EngineServer(
            EngineConfig(dtype="fp32", weight_version="5", always_return_routed_experts=True)
        )
        for _ in range(2)
    ]
    urls = [s.start() for s in servers]
    yield urls, servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def router(engines):
    with stock_sglang_router(engines[0]) as url:  # ready when both workers are healthy
        yield url


async def test_generate_through_sglang_router(engines, router) -> None:
    _, servers = engines
    before = [s.engine.scheduler.steps for s in servers]
    body = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"max_new_tokens": 6},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(post(s, router + "/generate", body) for _ in range(8)))
    for status, ans in answers:
        assert status == 200, ans
        meta = ans["meta_info"]
        assert len(ans["output_ids"]) == 6 and meta["finish_reason"]["type"] == "length"
        assert meta["weight_version"] == "5"
        assert [e[1] for e in meta["output_token_logprobs"]] == ans["output_ids"]
        # the stock router re-serialises requests and drops `return_routed_experts` (slime
        # uses a fork for R3); engines started with always_return_routed_experts still send
        # them, and the router passes the response's meta_info through untouched
        routed = decode_routed_experts(meta["routed_experts"], num_layers=2, topk=2)
        assert routed.shape == (4 + 6 - 1, 2, 2)
    after = [s.engine.scheduler.steps for s in servers]
    assert all(a > b for a, b in zip(after, before)), "round robin should use both engines"


async def test_router_info_and_malformed_passthrough(engines, router) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(router + "/get_model_info") as r:
            assert r.status == 200
            assert (await r.json())["model_type"] == "qwen3_moe"
        # the router re-serialises sampling_params (unknown keys vanish), but an engine's
        # 400 for a bad token id reaches the client as a 400
        status, body = await post(s, router + "/generate", {"input_ids": [1, 99999]})
    assert status == 400, body
