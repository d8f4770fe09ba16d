"""Fault tolerance against real engine processes: SIGKILL mid-load, restart, elastic join/leave,
mid-stream loss. Engines run in child processes (`router.testing.EngineProcess`) so a kill is
a real crash (connections reset, port closed)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from router import Router, RouterClient, RouterConfig
from router.testing import EngineProcess, FakeEngine, FakeEngineConfig
from router.workers import WorkerState

pytestmark = pytest.mark.timeout(90)

ENGINE = {"step_s": 0.002, "tokens_per_step": 5}


async def _wait(cond, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


def _gen(tokens: int, **extra) -> dict:
    return {"text": "hello", "sampling_params": {"max_new_tokens": tokens}, **extra}


async def test_engine_killed_mid_load_loses_no_request_and_is_readmitted() -> None:
    survivors = EngineProcess.spawn(count=2, name="survivor", **ENGINE)
    victim = EngineProcess.spawn(count=1, name="victim", **ENGINE)
    victim_url = victim.urls[0]
    cfg = RouterConfig(
        worker_urls=(*survivors.urls, victim_url),
        health_interval_s=0.2,
        health_timeout_s=0.5,
        failure_threshold=2,
        max_retries=3,
    )
    router = Router(cfg)
    url = await router.start()
    restarted = None
    try:
        await _wait(lambda: len(router.registry.healthy()) == 3)
        vw = router.registry.find_url(victim_url)
        statuses: list[int] = []
        served_by: list[str] = []
        sem = asyncio.Semaphore(12)

        async def one(s: aiohttp.ClientSession, i: int) -> None:
            async with sem:
                r = await s.post(url + "/generate", json=_gen(100, rid=f"q{i}"))
                statuses.append(r.status)
                if r.status == 200:
                    served_by.append((await r.json())["meta_info"]["engine"])

        async with aiohttp.ClientSession() as s:
            load = [asyncio.create_task(one(s, i)) for i in range(90)]
            await _wait(lambda: vw.outstanding_requests >= 2)  # the victim is busy
            in_flight_on_victim = vw.outstanding_requests
            victim.kill()
            t_kill = time.monotonic()
            await _wait(lambda: vw.state is WorkerState.QUARANTINED, timeout=5)
            quarantine_s = time.monotonic() - t_kill
            await asyncio.gather(*load)

            assert statuses == [200] * 90  # zero failed client requests
            assert in_flight_on_victim >= 2 and router.proxy.stats.retries >= 1
            # quarantined within the configured detection window (threshold x interval + timeout),
            # plus 0.5 s of scheduling slack for a loaded 2-core CI machine
            window = cfg.failure_threshold * cfg.health_interval_s + cfg.health_timeout_s
            assert quarantine_s <= window + 0.5, f"quarantined after {quarantine_s:.2f}s"
            assert vw.quarantines == 1

            # Restart on the same port: re-admitted by the health checker, then gets traffic.
            port = int(victim_url.rsplit(":", 1)[1])
            restarted = EngineProcess.spawn(ports=[port], name="restarted", **ENGINE)
            await _wait(lambda: vw.state is WorkerState.HEALTHY, timeout=5)
            again = []
            for i in range(6):
                r = await s.post(url + "/generate", json=_gen(5, rid=f"after{i}"))
                assert r.status == 200
                again.append((await r.json())["meta_info"]["engine"])
            assert "restarted" in again
        m = router.router_counters()
        assert m["failed"] == 0 and m["quarantines"] == 1
    finally:
        await router.stop()
        survivors.kill()
        victim.kill()
        if restarted is not None:
            restarted.kill()


async def test_stream_losing_its_engine_after_first_byte_reports_error_once() -> None:
    proc = EngineProcess.spawn(count=1, name="doomed", step_s=0.01, tokens_per_step=1)
    router = Router(RouterConfig(worker_urls=tuple(proc.urls), health_interval_s=0.2))
    url = await router.start()
    try:
        await _wait(lambda: len(router.registry.healthy()) == 1)
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/generate", json=_gen(500, stream=True))
            assert r.status == 200
            first = await r.content.readline()
            assert first.startswith(b"data: {")
            proc.kill()
            rest = [line async for line in r.content if line.strip()]
        err = json.loads(rest[-1][len(b"data: ") :])
        assert err["error"]["code"] == 502 and err["error"]["retryable"] is True
        assert b"[DONE]" not in b"".join(rest)
        assert router.proxy.stats.stream_broken == 1
    finally:
        await router.stop()
        proc.kill()


async def test_worker_added_at_runtime_gets_traffic_and_removed_one_does_not() -> None:
    engines = [FakeEngine(FakeEngineConfig(name=f"e{i}", step_s=0.001)) for i in range(2)]
    first = await engines[0].start()
    router = Router(RouterConfig(worker_urls=(first,), health_interval_s=0.1))
    url = await router.start()
    try:
        async with RouterClient(url) as rc, aiohttp.ClientSession() as s:
            await _wait(lambda: len(router.registry.healthy()) == 1)
            wid = await rc.add_worker(await engines[1].start(), wait_healthy_s=5)
            assert {w["url"] for w in await rc.list_workers()} == {first, engines[1].url}
            for _ in range(8):
                assert (await s.post(url + "/generate", json=_gen(3))).status == 200
            assert len(engines[1].requests) >= 3  # idle engines share traffic
            r = await s.get(f"{url}/workers/{wid}")
            assert r.status == 200 and (await r.json())["is_healthy"]

            await rc.remove_worker(engines[1].url)
            before = len(engines[1].requests)
            for _ in range(4):
                assert (await s.post(url + "/generate", json=_gen(3))).status == 200
            assert len(engines[1].requests) == before
            assert (await s.delete(f"{url}/workers/{wid}")).status == 404
            bad = await s.post(url + "/workers", json={"url": "localhost:1234"})
            assert bad.status == 400 and "http://" in (await bad.json())["error"]["message"]
    finally:
        await router.stop()
        for e in engines:
            await e.stop()


async def test_an_engine_slow_to_answer_its_probes_stays_in_rotation_by_default() -> None:
    """With the default probe settings (sglang-router's: 5 s, 3 failures) an engine whose
    `/health` takes 3 s (a loaded node) is never quarantined; one that stops answering is."""
    slow, dead = FakeEngine(), FakeEngine()
    urls = [await slow.start(), await dead.start()]
    slow.health_delay_s = 3.0
    router = Router(RouterConfig(worker_urls=tuple(urls)))
    await router.start()
    try:
        await _wait(lambda: len(router.registry.healthy()) == 2)
        dead.healthy = False
        await asyncio.sleep(8.0)
        assert router.registry.find_url(urls[0]).state is WorkerState.HEALTHY
        assert router.registry.find_url(urls[1]).state is WorkerState.QUARANTINED
    finally:
        await router.stop()
        await slow.stop()
        await dead.stop()
