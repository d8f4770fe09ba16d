"""SGLang API details a slime user's client relies on, on our real engine over HTTP, and what
the real `sglang-router` binary (PyPI sglang-router 0.3.2) does to requests in front of it:
it drops `custom_params` and `return_routed_experts` and has no control routes, which the
launcher's routing-replay probe turns into a refusal instead of a failure at the first step."""

from __future__ import annotations

import aiohttp
import pytest
import torch

from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.testing import post, stock_sglang_router
from slime_async.rollout.generate.client import GenerateError, check_routed_experts

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    srv = EngineServer(EngineConfig(dtype="fp32", weight_version="3"))
    url = srv.start()
    yield url, srv
    srv.stop()


async def _get(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        return await r.json()


async def test_server_info_reports_what_sglang_reports(engine) -> None:
    url, srv = engine
    port = int(url.rsplit(":", 1)[1])
    for path in ("/server_info", "/get_server_info"):
        info = await _get(url + path)
        assert info["port"] == port == srv.port  # the bound port, not the configured 0
        assert info["served_model_name"] == info["model_path"] == "tiny-moe"
        assert info["tokenizer_path"] == "tiny-moe"  # SGLang's default: the model path
        assert info["max_context_length"] == info["context_length"] > 0
    model = await _get(url + "/model_info")
    assert model["tokenizer_path"] == model["model_path"] == "tiny-moe"


async def test_custom_params_is_accepted_as_any_object(engine) -> None:
    url, _ = engine
    async with aiohttp.ClientSession() as s:
        sp = {
            "max_new_tokens": 2,
            "top_p": 0.9,
            "custom_params": {"top_p_replay": [1, 2], "x": None},
        }
        status, ans = await post(s, url + "/generate", {"input_ids": [1, 2], "sampling_params": sp})
        assert status == 200 and len(ans["output_ids"]) == 2
        sp["custom_params"] = "not an object"
        status, ans = await post(s, url + "/generate", {"input_ids": [1, 2], "sampling_params": sp})
    assert status == 400 and "custom_params must be a JSON object" in str(ans)


@pytest.fixture(scope="module")
def stock_router(engine):
    pytest.importorskip("sglang_router", reason="sglang-router wheel not installed")
    with stock_sglang_router([engine[0]]) as url:
        yield url


async def test_what_the_stock_router_drops(engine, stock_router, monkeypatch) -> None:
    """Documented in docs/coming-from-slime.md: the body the engine receives has neither
    `custom_params` nor `return_routed_experts`, and control routes answer 404."""
    import slime_async.engine.routes_generate as server

    seen: list[dict] = []
    real = server.parse_generate

    def spy(body, **kw):
        seen.append(body)
        return real(body, **kw)

    monkeypatch.setattr(server, "parse_generate", spy)
    body = {
        "input_ids": [1, 2, 3],
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": {
            "max_new_tokens": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "custom_params": {"a": 1},
        },
    }
    async with aiohttp.ClientSession() as s:
        status, ans = await post(s, stock_router + "/generate", body)
        assert status == 200 and len(ans["output_ids"]) == 2
        got = seen[-1]
        assert "return_routed_experts" not in got and "routed_experts" not in ans["meta_info"]
        assert "custom_params" not in got["sampling_params"]
        assert got["sampling_params"]["top_p"] == pytest.approx(0.9)  # sampling keys survive
        for path in (
            "/pause_generation",
            "/continue_generation",
            "/update_weights_from_disk",
            "/abort_request",
            "/update_weight_version",
        ):
            async with s.post(stock_router + path, json={}) as r:
                assert r.status == 404, path


async def test_routing_replay_probe_refuses_the_stock_router(engine, stock_router) -> None:
    url, _ = engine
    await check_routed_experts(url)  # the engine itself returns routing when asked
    with pytest.raises(GenerateError, match="stock sglang-router drops return_routed_experts"):
        await check_routed_experts(stock_router)


async def test_routing_replay_probe_accepts_always_return_behind_the_stock_router() -> None:
    """Engines started with --always-return-routed-experts keep R3 working behind it."""
    pytest.importorskip("sglang_router", reason="sglang-router wheel not installed")
    srv = EngineServer(EngineConfig(dtype="fp32", always_return_routed_experts=True))
    try:
        with stock_sglang_router([srv.start()]) as router:
            await check_routed_experts(router)
    finally:
        srv.stop()
