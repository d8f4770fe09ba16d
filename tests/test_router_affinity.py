"""Group affinity (router/affinity.py): a GRPO group's requests stay on one engine while the
balance allows and are split when it does not; late binding's room rule still holds; the key is
the `X-Group-Key` header, else the prompt. Unit tests run the real dispatcher, registry and
policy; the end-to-end test sends real HTTP through the router to real test engines."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from router import Router, RouterConfig
from router.affinity import GroupAffinity, group_key
from router.dispatch import Dispatcher
from router.policies import make_policy
from router.testing import FakeEngine, FakeEngineConfig
from router.workers import WorkerRegistry

pytestmark = pytest.mark.timeout(90)


def _dispatcher(n: int, *, slack: int, capacity: int = 0) -> tuple[Dispatcher, list]:
    reg = WorkerRegistry(failure_threshold=2, success_threshold=1)
    ws = [reg.add(f"http://127.0.0.1:{32000 + i}") for i in range(n)]
    for w in ws:
        reg.record_success(w)
    d = Dispatcher(
        registry=reg,
        policy=make_policy("least_expected_tokens"),
        capacity_tokens=capacity,
        wait_for_worker_s=30.0,
        affinity=GroupAffinity(slack_tokens=slack),
    )
    return d, ws


async def test_a_group_stays_on_one_engine_while_balance_allows() -> None:
    d, ws = _dispatcher(3, slack=4096)
    got = [await d.acquire(ws, 500, group="g") for _ in range(8)]
    assert len({w.id for w in got}) == 1  # 8 x 500 = 4000 ahead of idle engines: within 4096
    other = [await d.acquire(ws, 500, group="h") for _ in range(4)]
    assert len({w.id for w in other}) == 1 and other[0] is not got[0]  # its own home
    assert d.affinity is not None and d.affinity.stats.kept == 7 + 3
    assert d.affinity.stats.split == 0 and d.affinity.stats.new == 2


async def test_a_group_is_split_when_its_engine_gets_too_far_ahead() -> None:
    d, ws = _dispatcher(2, slack=1000)
    got = [await d.acquire(ws, 500, group="g") for _ in range(4)]
    a, b = ws if got[0] is ws[0] else ws[::-1]
    # a: 500 -> 1000 -> 1500 (each time at most 1000 ahead of b's 0), then 1500 > 1000: split
    assert got == [a, a, a, b]
    assert a.outstanding_tokens - b.outstanding_tokens <= 1000 + 500
    assert d.affinity is not None and d.affinity.stats.split == 1
    # b now holds the prompt too: the group's next request follows it there
    assert await d.acquire(ws, 500, group="g") is b


async def test_late_binding_room_wins_over_affinity_and_zero_slack_is_off() -> None:
    d, ws = _dispatcher(2, slack=10_000, capacity=1000)
    first = await d.acquire(ws, 1000, group="g")  # its engine is now full (1000 >= 1000)
    second = await d.acquire(ws, 1000, group="g")
    assert second is not first  # the home has no room: split, never over capacity
    queued = asyncio.ensure_future(d.acquire(ws, 100, group="g"))
    await asyncio.sleep(0)
    assert not queued.done()  # both full: waits in the router's queue
    d.release(first, 1000)
    assert await queued is first  # ...and binds where room appeared
    off, ws2 = _dispatcher(2, slack=0)
    got = [await off.acquire(ws2, 500, group="g") for _ in range(4)]
    assert len({w.id for w in got}) == 2  # the policy alone: spread


def test_group_key_is_the_header_else_the_prompt() -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {}}
    assert group_key("run7-g3", body) == "h:run7-g3"
    assert group_key(None, body) == group_key(None, {"input_ids": [1, 2, 3], "rid": "other"})
    assert group_key(None, body) != group_key(None, {"input_ids": [1, 2, 4]})
    assert group_key(None, {"text": "hi"}) == group_key(None, {"text": "hi", "rid": "x"})
    assert group_key(None, {"messages": [{"role": "user", "content": "hi"}]}) is not None
    assert group_key(None, [body, body]) is None  # a batch has no single group
    assert group_key(None, {"input_ids": [[1, 2], [3]]}) is None
    assert group_key(None, body, by_prompt=False) is None  # the default: the header only


async def test_router_keeps_a_grpo_group_on_one_engine_end_to_end() -> None:
    engines = [
        FakeEngine(FakeEngineConfig(name=f"e{i}", step_s=0.001, tokens_per_step=8))
        for i in range(3)
    ]
    urls = [await e.start() for e in engines]
    router = Router(
        RouterConfig(worker_urls=tuple(urls), health_interval_s=0.1, group_affinity_by_prompt=True)
    )
    url = await router.start()
    for _ in range(200):
        if len(router.registry.healthy()) == 3:
            break
        await asyncio.sleep(0.05)
    try:
        async with aiohttp.ClientSession() as s:

            async def one(group: int, sample: int, header: bool) -> None:
                body = {
                    "input_ids": [group, 7, 7, 7],
                    "rid": f"g{group}-s{sample}",
                    "sampling_params": {"max_new_tokens": 16},
                }
                hdr = {"X-Expected-Tokens": "16"}
                if header:
                    hdr["X-Group-Key"] = f"grp{group}"
                    body["input_ids"] = [sample, group]  # different prompts, one group key
                async with s.post(url + "/generate", json=body, headers=hdr) as r:
                    assert r.status == 200

            await asyncio.gather(*(one(g, i, header=g >= 3) for g in range(6) for i in range(4)))
        where: dict[str, set[str]] = {}
        for e in engines:
            for req in e.requests:
                where.setdefault(req["rid"].split("-")[0], set()).add(e.cfg.name)
        assert len(where) == 6 and all(len(v) == 1 for v in where.values()), where
        assert len({next(iter(v)) for v in where.values()}) > 1  # groups still spread
        m = router.router_counters()
        assert m["group_kept"] == 6 * 3 and m["group_split"] == 0
    finally:
        await router.stop()
        for e in engines:
            await e.stop()


def test_affinity_flag_round_trips_and_a_negative_one_is_refused() -> None:
    from router.config import validate_config

    with pytest.raises(ValueError, match="group-affinity-tokens"):
        validate_config(RouterConfig(group_affinity_tokens=-1))


async def test_bench_engines_charge_prefill_only_for_uncached_prompt_tokens() -> None:
    """The benchmark's backends (router.testing): an LRU page cache per engine, prefill work
    only for what it misses, so a group placed on one engine prefills its prompt once."""
    eng = FakeEngine(FakeEngineConfig(prefill_cost=1.0, cache_tokens=64, step_s=0.0001))
    url = await eng.start()
    prompt = " ".join(f"w{i}" for i in range(40))
    try:
        async with aiohttp.ClientSession() as s:
            metas = []
            for text in (prompt, prompt, prompt + " more", "other " * 80):
                body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
                async with s.post(url + "/generate", json=body) as r:
                    metas.append((await r.json())["meta_info"])
            again = {"text": prompt, "sampling_params": {"max_new_tokens": 2}}
            async with s.post(url + "/generate", json=again) as r:
                evicted = (await r.json())["meta_info"]
    finally:
        await eng.stop()
    assert [m["cached_tokens"] for m in metas] == [0, 32, 32, 0]  # whole 16-token pages
    assert evicted["cached_tokens"] == 0  # 80 tokens of "other" pushed it out of 64
    assert eng.prompt_tokens == 40 + 40 + 41 + 80 + 40 and eng.cached_tokens == 64
