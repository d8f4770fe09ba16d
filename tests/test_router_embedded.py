"""The router in front of the real embedded engine (`slime_async.engine`, tiny MoE on CPU):
pass-through of logprobs / routed experts / weight_version, streaming, version fan-out."""

from __future__ import annotations

import json

import aiohttp
import pytest

from router import Router, RouterClient, RouterConfig
from slime_async.contracts.rollout import decode_routed_experts

engine_mod = pytest.importorskip("slime_async.engine")
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def engine_urls():
    import torch

    from slime_async.contracts.model import TINY_MOE

    torch.set_num_threads(1)
    servers = [engine_mod.EngineServer(engine_mod.EngineConfig(num_threads=1)) for _ in range(2)]
    try:
        yield [s.start() for s in servers], TINY_MOE
    finally:
        for s in servers:
            s.stop()


async def test_embedded_engines_behind_the_router(engine_urls) -> None:
    urls, spec = engine_urls
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=0.2))
    url = await router.start()
    prompt = [5, 17, 33, 2, 9, 40]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    try:
        async with RouterClient(url) as rc, aiohttp.ClientSession() as s:
            workers = await rc.list_workers()
            assert len(workers) == 2
            direct = await (await s.post(urls[0] + "/generate", json=body)).json()
            for _ in range(4):  # both engines answer; same greedy output, all fields intact
                r = await s.post(url + "/generate", json=body, headers={"X-Expected-Tokens": "6"})
                assert r.status == 200, await r.text()
                got = await r.json()
                assert got["output_ids"] == direct["output_ids"]
                meta = got["meta_info"]
                assert meta["weight_version"] == "default"
                assert [t[1] for t in meta["output_token_logprobs"]] == got["output_ids"]
                experts = decode_routed_experts(
                    meta["routed_experts"], num_layers=spec.num_layers, topk=spec.moe_topk
                )
                assert experts.shape == (len(prompt) + 6 - 1, spec.num_layers, spec.moe_topk)
            assert {w["total_requests"] for w in (await rc.list_workers())} == {2}

            reply = await rc.update_weight_version(3)
            assert reply["succeeded"] == 2
            versions = set()
            for _ in range(4):
                got = await (await s.post(url + "/generate", json=body)).json()
                versions.add(got["meta_info"]["weight_version"])
            assert versions == {"3"}

            r = await s.post(url + "/generate", json={**body, "stream": True})
            assert r.headers["Content-Type"].startswith("text/event-stream")
            lines = [ln for ln in (await r.read()).split(b"\n") if ln.strip()]
            assert lines[-1] == b"data: [DONE]"
            final = json.loads(lines[-2][len(b"data: ") :])
            assert final["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        await router.stop()
