"""The router under bad clients and careless operators (issue 17): retries only for engine faults
and on at most two engines, a sustained poisoning client that hurts nobody, its own URL refused
as a worker, `/health` honest about having no engine, deep JSON and blank tokens refused.

Engines are real HTTP servers: the embedded engine (`EngineServer`) for the poison test, the
router's `FakeEngine` where an engine must answer a chosen status."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from router import Router, RouterConfig
from router.config import validate_config
from router.testing import FakeEngine, FakeEngineConfig
from slime_async.engine import EngineConfig, EngineServer

pytestmark = pytest.mark.timeout(240)


async def _fake_fleet(n: int, **kw) -> tuple[Router, list[FakeEngine], str]:
    engines = [FakeEngine(FakeEngineConfig(name=f"e{i}", step_s=0.001)) for i in range(n)]
    urls = tuple([await e.start() for e in engines])
    router = Router(RouterConfig(worker_urls=urls, health_interval_s=0.1, **kw))
    url = await router.start()
    while len(router.registry.healthy()) < n:
        await router.registry.wait_for_healthy(5.0)
        await asyncio.sleep(0.01)
    return router, engines, url


async def _stop(router: Router, engines: list[FakeEngine]) -> None:
    await router.stop()
    for e in engines:
        await e.stop()


async def test_a_request_failing_with_5xx_is_tried_on_at_most_two_engines() -> None:
    router, engines, url = await _fake_fleet(3, max_retries=5, failure_threshold=100)
    for e in engines:
        e.fail_status = 500
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + "/generate", json={"text": "x"})
        assert r.status == 500
    assert sum(len(e.requests) for e in engines) == 2
    assert len([e for e in engines if e.requests]) == 2
    await _stop(router, engines)


async def test_a_4xx_is_passed_through_never_retried_nor_counted() -> None:
    router, engines, url = await _fake_fleet(2, max_retries=3, failure_threshold=1)
    for e in engines:
        e.fail_status = 400
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            r = await s.post(url + "/generate", json={"text": "x"})
            assert r.status == 400
    assert sum(len(e.requests) for e in engines) == 5
    assert router.proxy.stats.retries == 0
    assert all(w.state.value == "healthy" and w.quarantines == 0 for w in router.registry.all())
    await _stop(router, engines)


@pytest.fixture(scope="module")
def two_engines():
    servers = [
        EngineServer(EngineConfig(dtype="fp32", seed=1, weight_version="0", max_running_requests=8))
        for _ in range(2)
    ]
    urls = [s.start() for s in servers]
    yield urls
    for s in servers:
        s.stop()


_POISON = [
    {"input_ids": [1, 2, 3], "sampling_params": {"stop_token_ids": [10**30], "min_new_tokens": 2}},
    {"input_ids": [1, 2, 3], "sampling_params": {"stop_token_ids": [999999], "min_new_tokens": 2}},
    {"input_ids": [1, 2, 3], "sampling_params": {"sampling_seed": 2**64, "n": 2}},
    {"input_ids": [1, 2, 3], "sampling_params": {"temperature": float("nan")}},
    {"input_ids": [1, 2, 10**30]},
    {"input_ids": [1, 2, 3], "sampling_params": {"top_p": 0}},
]


async def test_sustained_poison_hurts_no_honest_client_and_no_engine(two_engines) -> None:
    """Four honest clients and one client sending only bad requests, through the router to two
    real engines, until every honest client has had 12 answers: every honest request succeeds,
    every bad one gets a 4xx, and no engine is ever quarantined."""
    router = Router(RouterConfig(worker_urls=tuple(two_engines), health_interval_s=0.2))
    url = await router.start()
    while len(router.registry.healthy()) < 2:
        await router.registry.wait_for_healthy(10.0)
        await asyncio.sleep(0.01)
    honest_status: list[int] = []
    bad_status: list[int] = []
    stop = asyncio.Event()
    rng = random.Random(0)

    async def honest(s: aiohttp.ClientSession, c: int) -> None:
        for i in range(12):
            body = {
                "input_ids": [1, c + 4, i + 5],
                "sampling_params": {
                    "max_new_tokens": 12,
                    "ignore_eos": True,
                    "min_new_tokens": 2,
                    "stop_token_ids": [2],
                },
            }
            async with s.post(url + "/generate", json=body) as r:
                honest_status.append(r.status)
                ans = await r.json()
                assert r.status == 200, ans
                assert len(ans["output_ids"]) == 12

    async def poisoner(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with s.post(url + "/generate", json=rng.choice(_POISON)) as r:
                bad_status.append(r.status)
                await r.read()

    async with aiohttp.ClientSession() as s:
        bad = asyncio.ensure_future(poisoner(s))
        await asyncio.gather(*(honest(s, c) for c in range(4)))
        stop.set()
        await bad
    await router.stop()
    assert honest_status == [200] * 48
    assert len(bad_status) >= 10 and all(400 <= st < 500 for st in bad_status), bad_status
    workers = router.registry.all()
    assert [w.quarantines for w in workers] == [0, 0]
    assert router.proxy.stats.retries == 0 and router.proxy.stats.failed == 0


async def test_router_refuses_its_own_url_as_a_worker() -> None:
    router = Router(RouterConfig())
    url = await router.start()
    port = url.rsplit(":", 1)[1]
    async with aiohttp.ClientSession() as s:
        for alias in (url, f"http://localhost:{port}", f"http://127.0.0.1:{port}/"):
            r = await s.post(url + "/workers", json={"url": alias})
            assert r.status == 400, alias
            assert "this router itself" in (await r.json())["error"]["message"]
    assert router.registry.all() == []
    await router.stop()


async def test_health_is_503_without_a_healthy_worker_and_200_with_one() -> None:
    router = Router(RouterConfig(health_interval_s=0.05))
    url = await router.start()
    engine = FakeEngine(FakeEngineConfig(name="late"))
    async with aiohttp.ClientSession() as s:
        r = await s.get(url + "/health")
        assert r.status == 503 and (await r.json())["healthy_workers"] == 0
        r = await s.get(url + "/liveness")
        assert r.status == 200  # the process is alive: liveness stays 200
        await s.post(url + "/workers", json={"url": await engine.start()})
        assert await router.registry.wait_for_healthy(10.0)
        r = await s.get(url + "/health")
        assert r.status == 200 and (await r.json())["healthy_workers"] == 1
    await router.stop()
    await engine.stop()


async def test_deeply_nested_json_is_a_400_not_a_500() -> None:
    router, engines, url = await _fake_fleet(1)
    deep = b'{"text": "x", "sampling_params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with aiohttp.ClientSession() as s:
        for path in ("/generate", "/workers"):
            r = await s.post(url + path, data=deep, headers={"Content-Type": "application/json"})
            assert r.status == 400, path
            assert "deep" in (await r.json())["error"]["message"]
    assert engines[0].requests == []
    await _stop(router, engines)


async def test_deeply_nested_json_is_a_400_at_the_engine(two_engines) -> None:
    deep = b'{"input_ids": [1], "sampling_params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with aiohttp.ClientSession() as s:
        for path in ("/generate", "/pause_generation", "/abort_request"):
            r = await s.post(two_engines[0] + path, data=deep)
            assert r.status == 400, path


@pytest.mark.parametrize("token", ["", "   ", "\t\n", " secret", "secret\n"])
def test_blank_or_padded_router_token_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="whitespace"):
        validate_config(RouterConfig(api_key=token))


async def test_slow_clients_do_not_hold_router_connections() -> None:
    """A client that never finishes its headers is disconnected; one that never finishes its
    body gets a 408 (both after `client_timeout_s`; the assertions wait on the server's answer)."""
    import socket
    from urllib.parse import urlsplit

    router = Router(RouterConfig(client_timeout_s=1.0))
    url = await router.start()
    u = urlsplit(url)

    def exchange(data: bytes) -> bytes:
        with socket.create_connection((u.hostname, u.port), timeout=60) as s:
            s.sendall(data)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out

    headers_only = b"POST /generate HTTP/1.1\r\nHost: x\r\n"
    assert await asyncio.to_thread(exchange, headers_only) == b""
    short_body = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    reply = await asyncio.to_thread(exchange, short_body)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    await router.stop()
