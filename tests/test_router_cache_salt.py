"""The prefix-cache salt (router/cache_salt.py): with `cache_salt` the router puts SGLang's
`extra_key` in every `/generate` body, changed by the push sequence (pause in place -> update
without a flush -> continue, the real `paused_in_place`), so an engine's radix cache never
shares a prefix across the push; the embedded engine (what the SGLang stand-in serves) honours
`extra_key` as SGLang does, and keeps reusing prefixes between pushes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
import torch

from router import Router, RouterClient, RouterConfig
from router.cache_salt import salt_body
from router.testing import FakeEngine, FakeEngineConfig
from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.model import load_model
from slime_async.engine.testing import post
from slime_async.weights.pause import paused_in_place

pytestmark = pytest.mark.timeout(120)


def test_salt_body_prepends_or_composes() -> None:
    raw = b'{"input_ids": [1, 2], "rid": "a"}'
    out = salt_body(raw, json.loads(raw), "s1")
    assert out == b'{"extra_key":"s1","input_ids": [1, 2], "rid": "a"}'
    own = {"input_ids": [1], "extra_key": "tenant"}
    assert json.loads(salt_body(json.dumps(own).encode(), own, "s1"))["extra_key"] == "tenant|s1"
    batch = {"input_ids": [[1], [2]], "extra_key": ["a", None]}
    salted = json.loads(salt_body(json.dumps(batch).encode(), batch, "s"))["extra_key"]
    assert salted == ["a|s", "s"]
    assert salt_body(b"[1]", [1], "s") == b"[1]"


async def _router(urls: list[str], **kw) -> tuple[Router, str]:
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=0.1, **kw))
    url = await router.start()
    for _ in range(200):
        if len(router.registry.healthy()) == len(urls):
            break
        await asyncio.sleep(0.05)
    return router, url


async def test_the_push_sequence_changes_the_salt_every_engine_sees() -> None:
    engines = [FakeEngine(FakeEngineConfig(name=f"e{i}")) for i in range(2)]
    urls = [await e.start() for e in engines]
    router, url = await _router(urls, cache_salt=True)
    plain, plain_url = await _router(urls[:1])
    gen = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    try:
        async with aiohttp.ClientSession() as s, RouterClient(url) as rc:
            await post(s, url + "/generate", gen)
            before = [r.get("extra_key") for e in engines for r in e.requests]
            async with paused_in_place(rc, 1):
                await rc.update_weights_from_disk("/w/v1", weight_version=1, flush_cache=False)
            for e in engines:
                e.requests.clear()
            await post(s, url + "/generate", gen)
            await post(s, url + "/generate", dict(gen, extra_key="tenant"))
            after = [r.get("extra_key") for e in engines for r in e.requests]
            for e in engines:
                e.requests.clear()
            await post(s, plain_url + "/generate", gen)  # cache_salt off: body untouched
            untouched = engines[0].requests[0]
    finally:
        await router.stop()
        await plain.stop()
        for e in engines:
            await e.stop()
    assert before == ["slime-p0-w0"]
    assert sorted(after) == ["slime-p1-w1", "tenant|slime-p1-w1"]
    assert "extra_key" not in untouched


def _save(d: Path, seed: int) -> str:
    load_model(EngineConfig(dtype="fp32", seed=seed)).model.save_pretrained(str(d))
    return str(d)


async def test_salted_push_through_the_router_on_the_sglang_stand_in(tmp_path: Path) -> None:
    """The engine SGLang's stand-in serves, behind the router with `cache_salt`: prefixes are
    reused between pushes (same salt), never across one; `extra_key` namespaces as in SGLang."""
    torch.set_num_threads(1)
    srv = EngineServer(EngineConfig(dtype="fp32", weight_version="0"))
    eng = srv.start()
    router, url = await _router([eng], cache_salt=True)
    new_dir = _save(tmp_path / "w1", seed=1)
    gen = {"input_ids": list(range(3, 30)), "sampling_params": {"max_new_tokens": 2}}
    cached = []
    try:
        async with aiohttp.ClientSession() as s, RouterClient(url) as rc:
            for _ in range(2):
                cached.append((await post(s, url + "/generate", gen))[1]["meta_info"])
            async with paused_in_place(rc, 1):
                res = await rc.update_weights_from_disk(
                    new_dir, weight_version=1, flush_cache=False
                )
                assert res["succeeded"] == 1 and not res["failed"], res
            for _ in range(2):
                cached.append((await post(s, url + "/generate", gen))[1]["meta_info"])
            # straight to the engine: only requests with the same extra_key share prefixes
            other = dict(gen, extra_key="elsewhere")
            cached.append((await post(s, eng + "/generate", other))[1]["meta_info"])
            cached.append((await post(s, eng + "/generate", other))[1]["meta_info"])
    finally:
        await router.stop()
        srv.stop()
    assert [m["cached_tokens"] for m in cached] == [0, 26, 0, 26, 0, 26]
    assert [m["weight_version"] for m in cached[:4]] == ["0", "0", "1", "1"]
