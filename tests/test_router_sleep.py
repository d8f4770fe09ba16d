"""Sleep and wake through our router, in front of two real embedded engines: a preempted
engine's in-flight requests are re-dispatched whole to the other engine (each answered exactly
once, complete, counted in `redispatched`), a sleeping engine gets no request and no control
fan-out, and on wake it catches up on the weight calls it missed before it serves again."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from router import Router, RouterConfig
from router.workers import WorkerState
from slime_async.engine.testing import post

engine_mod = pytest.importorskip("slime_async.engine")
pytestmark = pytest.mark.timeout(180)
N_TOKENS = 160


@pytest.fixture(scope="module")
def engine_urls():
    import torch

    torch.set_num_threads(1)
    servers = [
        engine_mod.EngineServer(engine_mod.EngineConfig(dtype="fp32", num_threads=1))
        for _ in range(2)
    ]
    try:
        yield [s.start() for s in servers]
    finally:
        for s in servers:
            s.stop()


def _body(i: int) -> dict:
    return {
        "rid": f"req-{i}",
        "input_ids": [3 + i, 1, 4, 1, 5],
        "sampling_params": {"max_new_tokens": N_TOKENS, "temperature": 0.0, "ignore_eos": True},
    }


async def _info(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/server_info") as r:
        return await r.json()


async def test_preempted_requests_are_redispatched_once_and_sleepers_catch_up(engine_urls):
    a_url, b_url = engine_urls
    router = Router(RouterConfig(worker_urls=(a_url, b_url), health_interval_s=0.1))
    url = await router.start()
    a = router.registry.find_url(a_url)
    try:
        async with aiohttp.ClientSession() as s:
            while len(router.registry.healthy()) < 2:
                await asyncio.sleep(0.05)
            reference = {}
            for i in range(4):  # what each request gives uncut (greedy: the same on any engine)
                _, out = await post(s, b_url + "/generate", _body(i))
                reference[f"req-{i}"] = out["output_ids"]
            jobs = [asyncio.ensure_future(post(s, url + "/generate", _body(i))) for i in range(4)]
            while not (
                a.outstanding_requests
                and (await _info(s, a_url))["internal_states"][0]["num_tokens"]
            ):
                await asyncio.sleep(0.01)
            cut = a.outstanding_requests
            level2 = {"tags": ["kv_cache", "weights"], "worker_urls": [a_url]}
            st, reply = await post(s, url + "/release_memory_occupation", level2)
            assert st == 200 and reply["succeeded"] == 1, reply
            assert a.state is WorkerState.SLEEPING and a.outstanding_requests == 0
            answers = await asyncio.gather(*jobs)
            # every request answered once, complete, with what it gives uncut
            assert [st for st, _ in answers] == [200] * 4
            got = {o["meta_info"]["id"]: o for _, o in answers}
            assert sorted(got) == sorted(reference)
            for rid, o in got.items():
                assert o["meta_info"]["finish_reason"]["type"] == "length", o["meta_info"]
                assert o["output_ids"] == reference[rid]
            assert router.proxy.stats.redispatched >= cut >= 1
            info = (await _info(s, a_url))["internal_states"][0]
            assert info["memory"]["sleep_level"] == 2 and info["idle"]
            # asleep: no request and no control call reaches it; the others get a new version
            served = a.total_requests
            for i in range(3):
                st, _ = await post(s, url + "/generate", {**_body(i), "rid": f"late-{i}"})
                assert st == 200
            assert a.total_requests == served
            st, reply = await post(s, url + "/update_weight_version", {"new_version": "5"})
            assert st == 200 and reply["total"] == 1
            async with s.get(a_url + "/model_info") as r:
                assert (await r.json())["weight_version"] == "default"
            # wake: the missed version is replayed before it serves again
            st, reply = await post(s, url + "/resume_memory_occupation", {"tags": None})
            assert st == 200 and reply["succeeded"] == 1, reply
            assert a.state is WorkerState.HEALTHY
            async with s.get(a_url + "/model_info") as r:
                assert (await r.json())["weight_version"] == "5"
            async with s.get(url + "/metrics") as r:
                m = (await r.json())["router"]
            assert m["redispatched"] >= cut and m["sleeps"] == 1 and m["wakes"] == 1
            assert m["failed"] == 0 and a.quarantines == 0
    finally:
        await router.stop()


async def test_sleep_body_errors_name_the_field(engine_urls):
    router = Router(RouterConfig(worker_urls=tuple(engine_urls), health_interval_s=0.1))
    url = await router.start()
    try:
        async with aiohttp.ClientSession() as s:
            bad = {"worker_urls": ["http://127.0.0.1:1"]}
            st, reply = await post(s, url + "/release_memory_occupation", bad)
            assert st == 400 and "not registered" in reply["error"]["message"]
            st, reply = await post(s, url + "/release_memory_occupation", {"tags": "weights"})
            assert st == 400 and "tags must be a list" in reply["error"]["message"]
    finally:
        await router.stop()


async def test_a_drained_sleep_lets_running_requests_finish_and_cuts_none(engine_urls):
    """`drain_s`: the engine leaves the rotation at once (a new request goes to the other), its
    running requests finish where they are (none cut, none re-dispatched), then it sleeps."""
    a_url, b_url = engine_urls
    router = Router(RouterConfig(worker_urls=(a_url, b_url), health_interval_s=0.1))
    url = await router.start()
    a = router.registry.find_url(a_url)
    try:
        async with aiohttp.ClientSession() as s:
            while len(router.registry.healthy()) < 2:
                await asyncio.sleep(0.05)
            jobs = [asyncio.ensure_future(post(s, url + "/generate", _body(i))) for i in range(4)]
            while not a.outstanding_requests:
                await asyncio.sleep(0.01)
            on_a, served = a.outstanding_requests, a.total_requests
            body = {"tags": ["kv_cache"], "worker_urls": [a_url], "drain_s": 60}
            sleeping = asyncio.ensure_future(post(s, url + "/release_memory_occupation", body))
            while a.state is not WorkerState.SLEEPING:
                await asyncio.sleep(0.01)
            st, _ = await post(s, url + "/generate", {**_body(9), "rid": "during-drain"})
            assert st == 200 and a.total_requests == served  # not sent to the draining one
            st, reply = await sleeping
            assert st == 200 and reply["succeeded"] == 1, reply
            answers = await asyncio.gather(*jobs)
            assert [st for st, _ in answers] == [200] * 4
            assert all(o["meta_info"]["finish_reason"]["type"] == "length" for _, o in answers)
            assert on_a >= 1 and router.proxy.stats.redispatched == 0
            st, reply = await post(s, url + "/release_memory_occupation", {"drain_s": -1})
            assert st == 400 and "drain_s" in reply["error"]["message"]
            st, reply = await post(s, url + "/resume_memory_occupation", {"tags": None})
            assert st == 200 and reply["succeeded"] == 1, reply
    finally:
        await router.stop()
