"""Late binding (router/dispatch.py): requests wait in the router until an engine has room.

Semantics pinned here, not speed: the queue's order (retries, then longest expected first, then
arrival), room accounting that always returns to zero, and exactly one answer per request with
many concurrent requests, an engine killed mid-way, and clients that disconnect while queued.
The dispatcher runs with the real registry and policy; the end-to-end tests use real HTTP
engines (`router.testing`), in-process or as killable child processes.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from router import Router, RouterConfig
from router.dispatch import Dispatcher
from router.policies import make_policy
from router.testing import EngineProcess, FakeEngine, FakeEngineConfig
from router.workers import WorkerRegistry, WorkerState

pytestmark = pytest.mark.timeout(90)


def _dispatcher(n: int, capacity: int, wait_s: float = 30.0) -> tuple[Dispatcher, list]:
    reg = WorkerRegistry(failure_threshold=2, success_threshold=1)
    ws = [reg.add(f"http://127.0.0.1:{31000 + i}") for i in range(n)]
    for w in ws:
        reg.record_success(w)
    d = Dispatcher(
        registry=reg,
        policy=make_policy("least_expected_tokens"),
        capacity_tokens=capacity,
        wait_for_worker_s=wait_s,
    )
    return d, ws


async def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.005)


async def test_queue_order_retries_then_longest_then_arrival() -> None:
    d, (w,) = _dispatcher(1, capacity=1)  # room only when idle: one request at a time
    first = await d.acquire([w], 100)
    order: list[str] = []

    async def req(name: str, expected: int, retry: bool = False) -> None:
        got = await d.acquire([w], expected, retry=retry)
        order.append(name)
        d.release(got, expected)  # finishes at once, making room for the next

    names = [("short-a", 10, False), ("long", 500, False), ("short-b", 10, False)]
    names += [("mid", 50, False), ("retry", 1, True)]
    tasks = []
    for name, expected, retry in names:
        tasks.append(asyncio.create_task(req(name, expected, retry)))
        await asyncio.sleep(0)  # enqueue in this arrival order
    await _wait(lambda: d.queue_length == len(names))
    d.release(first, 100)
    await asyncio.gather(*tasks)
    assert order == ["retry", "long", "mid", "short-a", "short-b"]
    assert (w.outstanding_requests, w.outstanding_tokens, d.queue_length) == (0, 0, 0)


async def test_room_is_below_capacity_and_zero_capacity_never_queues() -> None:
    d, ws = _dispatcher(2, capacity=100)
    a = await d.acquire(ws, 150)  # an empty engine takes even an oversized request
    b = await d.acquire(ws, 60)
    assert a is not b
    c = await d.acquire(ws, 60)  # b has 60 < 100: room
    assert c is b and b.outstanding_tokens == 120
    waiting = asyncio.create_task(d.acquire(ws, 10))
    await _wait(lambda: d.queue_length == 1)
    info = await d.acquire(ws, 0)  # zero expected work (info routes) never waits
    d.release(info, 0)
    d.release(b, 60)  # b: 60 < 100 -> the queued request is bound to b
    assert await waiting is b and d.queue_length == 0

    unlimited, ws2 = _dispatcher(2, capacity=0)
    for _ in range(50):
        await unlimited.acquire(ws2, 10_000)
    assert unlimited.queue_length == 0 and unlimited.stats.queued == 0
    assert sorted(w.outstanding_tokens for w in ws2) == [250_000, 250_000]


async def test_cancelled_waiter_leaves_no_trace_and_others_still_bind() -> None:
    d, (w,) = _dispatcher(1, capacity=10)
    held = await d.acquire([w], 10)
    gone = asyncio.create_task(d.acquire([w], 5))
    stays = asyncio.create_task(d.acquire([w], 10))
    await _wait(lambda: d.queue_length == 2)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert d.queue_length == 1 and d.stats.queue_abandoned == 1
    d.release(held, 10)
    assert await stays is w
    assert (w.outstanding_requests, w.outstanding_tokens) == (1, 10)

    # Bound from the queue, then cancelled before resuming: the bind is released.
    late = asyncio.create_task(d.acquire([w], 7))
    await _wait(lambda: d.queue_length == 1)
    d.release(w, 10)  # binds `late` (future resolved) ...
    late.cancel()  # ... but its client went away before the task ran again
    with pytest.raises(asyncio.CancelledError):
        await late
    assert (w.outstanding_requests, w.outstanding_tokens, d.queue_length) == (0, 0, 0)


async def test_queued_requests_go_to_an_admitted_engine_or_time_out_without_one() -> None:
    d, (a, b) = _dispatcher(2, capacity=10, wait_s=0.3)
    await d.acquire([a, b], 10)
    await d.acquire([a, b], 10)  # both engines full
    d.registry.quarantine(b, "test")
    queued = asyncio.create_task(d.acquire([a], 3))
    await _wait(lambda: d.queue_length == 1)
    d.release(b, 10)  # room on b, but b is quarantined: nothing is bound
    await asyncio.sleep(0.01)
    assert d.queue_length == 1
    d.registry.admit(b)  # re-admission binds the waiting request at once
    assert await queued is b

    assert await d.acquire([a, b], 10) is b  # a: 10, b: 13, both full again
    orphan = asyncio.create_task(d.acquire([a, b], 3))
    await _wait(lambda: d.queue_length == 1)
    d.registry.quarantine(a, "test")
    d.registry.quarantine(b, "test")
    d.release(a, 10)  # a has room now, but no engine is healthy
    assert await orphan is None  # answered (503) after wait_for_worker_s, not left hanging
    assert d.stats.queue_timeouts == 1 and d.queue_length == 0


async def test_retry_avoids_the_engine_it_failed_on_when_another_has_room() -> None:
    d, (a, b) = _dispatcher(2, capacity=10)
    first = await d.acquire([a, b], 10)
    other = b if first is a else a
    blocker = await d.acquire([a, b], 10)
    assert blocker is other
    retry = asyncio.create_task(d.acquire([other], 4, exclude={first.id}, retry=True))
    await _wait(lambda: d.queue_length == 1)
    d.release(first, 10)  # room on the engine it failed on: not taken while another may free
    await asyncio.sleep(0.01)
    assert not retry.done()
    d.release(blocker, 10)
    assert await retry is other


# --- end to end: real HTTP engines -----------------------------------------------------------
async def _router(urls, **kw) -> tuple[Router, str]:
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=0.1, **kw))
    url = await router.start()
    await _wait(lambda: len(router.registry.healthy()) == len(urls))
    return router, url


def _gen(tokens: int, rid: str) -> dict:
    return {"text": f"p {rid}", "rid": rid, "sampling_params": {"max_new_tokens": tokens}}


async def test_many_concurrent_requests_each_answered_once_and_served_once() -> None:
    engines = [
        FakeEngine(FakeEngineConfig(name=f"e{i}", step_s=0.001, tokens_per_step=8))
        for i in range(3)
    ]
    urls = [await e.start() for e in engines]
    router, url = await _router(urls, worker_capacity_tokens=64)
    n = 300
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def one(i: int) -> tuple[str, int]:
                tokens = 1 + (i * 37) % 60
                hdr = {"X-Expected-Tokens": str(tokens)}
                async with s.post(url + "/generate", json=_gen(tokens, f"q{i}"), headers=hdr) as r:
                    body = await r.json()
                    assert r.status == 200 and body["meta_info"]["completion_tokens"] == tokens
                    return body["meta_info"]["id"], r.status

            answers = await asyncio.gather(*(one(i) for i in range(n)))
        assert sorted(rid for rid, _ in answers) == sorted(f"q{i}" for i in range(n))
        served = [req["rid"] for e in engines for req in e.requests]
        assert sorted(served) == sorted(f"q{i}" for i in range(n))  # no loss, no duplicate
        m = router.router_counters()
        assert m["queued"] > 0 and m["queue_peak"] > 0  # late binding was exercised
        assert m["queue_length"] == 0 and m["outstanding_tokens"] == 0
        assert m["outstanding_requests"] == 0 and m["succeeded"] == n and m["failed"] == 0
    finally:
        await router.stop()
        for e in engines:
            await e.stop()


async def test_engine_killed_while_requests_queue_loses_none() -> None:
    engine = {"step_s": 0.002, "tokens_per_step": 5}
    survivors = EngineProcess.spawn(count=2, name="survivor", **engine)
    victim = EngineProcess.spawn(count=1, name="victim", **engine)
    router, url = await _router(
        [*survivors.urls, victim.urls[0]],
        worker_capacity_tokens=150,
        health_timeout_s=0.5,
        max_retries=3,
    )
    vw = router.registry.find_url(victim.urls[0])
    n = 120
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

            async def one(i: int) -> tuple[int, str]:
                hdr = {"X-Expected-Tokens": "100"}
                async with s.post(url + "/generate", json=_gen(100, f"k{i}"), headers=hdr) as r:
                    body = await r.json()
                    return r.status, body["meta_info"]["id"]

            load = [asyncio.create_task(one(i)) for i in range(n)]
            await _wait(lambda: vw.outstanding_requests >= 1 and router.dispatcher.queue_length)
            victim.kill()
            answers = await asyncio.gather(*load)
        assert [st for st, _ in answers] == [200] * n
        assert sorted(rid for _, rid in answers) == sorted(f"k{i}" for i in range(n))
        assert vw.state is WorkerState.QUARANTINED
        m = router.router_counters()
        assert m["retries"] >= 1 and m["failed"] == 0 and m["queued"] > 0
        assert m["queue_length"] == 0 and m["outstanding_requests"] == 0
    finally:
        await router.stop()
        survivors.kill()
        victim.kill()


async def test_clients_leaving_while_queued_are_never_sent_and_free_nothing_twice() -> None:
    engine = FakeEngine(FakeEngineConfig(name="e0", step_s=0.002, tokens_per_step=10))
    router, url = await _router([await engine.start()], worker_capacity_tokens=100)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            hold = await s.post(engine.url + "/pause_generation", json={"mode": "in_place"})
            assert hold.status == 200  # the engine holds `busy` until continued below
            hdr = {"X-Expected-Tokens": "100"}
            busy = asyncio.create_task(
                s.post(url + "/generate", json=_gen(30, "busy"), headers=hdr)
            )
            await _wait(lambda: len(engine.requests) == 1)
            leavers = [
                asyncio.create_task(s.post(url + "/generate", json=_gen(5, f"x{i}"), headers=hdr))
                for i in range(10)
            ]
            stayer = asyncio.create_task(
                s.post(url + "/generate", json=_gen(5, "stay"), headers={"X-Expected-Tokens": "1"})
            )
            await _wait(lambda: router.dispatcher.queue_length == 11)
            for t in leavers:
                t.cancel()  # closes the client connection: the router cancels the handler
            await asyncio.gather(*leavers, return_exceptions=True)
            await _wait(lambda: router.dispatcher.stats.queue_abandoned == 10)
            assert (await s.post(engine.url + "/continue_generation", json={})).status == 200
            assert (await busy).status == 200
            r = await stayer
            assert r.status == 200 and (await r.json())["meta_info"]["id"] == "stay"
        assert [req["rid"] for req in engine.requests] == ["busy", "stay"]
        m = router.router_counters()
        assert m["queue_length"] == 0 and m["outstanding_requests"] == 0
        assert m["outstanding_tokens"] == 0
    finally:
        await router.stop()
        await engine.stop()


def test_capacity_flag_round_trips_and_a_negative_one_is_refused() -> None:
    import argparse

    from router.config import add_router_args, router_config_from_args, validate_config

    ap = argparse.ArgumentParser()
    add_router_args(ap)
    cfg = router_config_from_args(ap.parse_args(["--router-worker-capacity-tokens", "2048"]))
    assert cfg.worker_capacity_tokens == 2048
    with pytest.raises(ValueError, match=r"worker-capacity-tokens .* must be >= 0"):
        validate_config(RouterConfig(worker_capacity_tokens=-1))


async def test_bench_engine_accounts_work_piecewise_whatever_the_wake_up_timing() -> None:
    """The benchmark's backends (`FakeEngine`) must not credit work by when they wake up: one
    late accounting call gives the same progress as the exact piecewise schedule."""
    from router.testing import _Job

    loop = asyncio.get_running_loop()
    e = FakeEngine(FakeEngineConfig(step_s=0.0, per_seq_s=0.01, tokens_per_step=10))
    # rate per request with n active: 10 / (0.01 n) = 1000 / n tokens/s
    t0 = loop.time()
    e._last = t0
    a = _Job(rid="a", target=300, done=loop.create_future(), arrived=t0)
    e._jobs.append(a)
    e._advance_to(t0 + 0.1)  # the arrival of b accounts a's solo work first
    b = _Job(rid="b", target=100, done=loop.create_future(), arrived=t0 + 0.1)
    e._jobs.append(b)
    e._advance_to(t0 + 0.35)  # one late wake-up: b ends at 0.3 (500/s), a then runs alone
    assert b.done.done() and b.generated == 100
    assert a.work == pytest.approx(250, abs=0.01)  # 100 + 0.2 * 500 + 0.05 * 1000
    e._advance_to(t0 + 1.0)
    assert a.done.done() and a.generated == 300 and not e._jobs
