"""An abort-mode pause through our router, in front of a real embedded engine: no generate request
is held while the fleet is paused. SGLang's engines hold a request that reaches them after
`/pause_generation {"mode": "abort"}` until `/continue_generation`; a request sent just before
the pause is such a request, and the data worker's `pause()` (which waits for every generation
to come back before the run continues the engines) then waited forever: the colocated run's
stall after a train step. The router answers those aborted (router/pause.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from data_worker.config import DataWorkerConfig
from data_worker.source import InMemoryPromptSource
from data_worker.worker import RolloutDataWorker
from router import Router, RouterConfig
from slime_async.engine.testing import post
from slime_async.rollout.data.sources import task_prompt
from slime_async.rollout.data.tasks import EOS, TaskFamily, TaskFamilyConfig
from slime_async.rollout.generate.client import GenerateClient, GenerateClientConfig

engine_mod = pytest.importorskip("slime_async.engine")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine_url():
    import torch

    torch.set_num_threads(1)
    srv = engine_mod.EngineServer(
        engine_mod.EngineConfig(dtype="fp32", seed=1, num_threads=1, weight_version="0")
    )
    try:
        yield srv.start()
    finally:
        srv.stop()


async def _router(engine_url: str) -> tuple[Router, str]:
    router = Router(RouterConfig(worker_urls=(engine_url,), health_interval_s=0.1))
    url = await router.start()
    while not router.registry.healthy():
        await asyncio.sleep(0.02)
    return router, url


def _body(rid: str, **extra) -> dict:
    return {
        "rid": rid,
        "input_ids": [3, 1, 4, 1, 5],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
        "return_logprob": True,
        **extra,
    }


async def test_a_request_sent_during_an_abort_pause_is_answered_aborted_not_held(engine_url):
    router, url = await _router(engine_url)
    try:
        async with aiohttp.ClientSession() as s:
            st, reply = await post(s, url + "/pause_generation", {"mode": "abort"})
            assert st == 200 and reply["succeeded"] == 1, reply
            # the engine holds it (SGLang's semantics): the router must not forward it there
            st, out = await asyncio.wait_for(post(s, url + "/generate", _body("late")), 5)
            assert st == 200, out
            meta = out["meta_info"]
            assert meta["finish_reason"]["type"] == "abort" and meta["id"] == "late"
            assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
            batch = [_body("b0"), _body("b1")]
            st, out = await asyncio.wait_for(post(s, url + "/generate", batch), 5)
            assert [o["meta_info"]["id"] for o in out] == ["b0", "b1"]
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            st, out = await asyncio.wait_for(post(s, url + "/v1/chat/completions", body), 5)
            assert st == 200 and out["choices"][0]["finish_reason"] == "abort"
            async with s.get(url + "/metrics") as r:
                m = (await r.json())["router"]
            assert m["aborted_paused"] == 3 and m["paused_abort"] == 1
            # an in-place pause holds requests as SGLang does; continue serves them
            await post(s, url + "/continue_generation", {})
            await post(s, url + "/pause_generation", {"mode": "in_place"})
            held = asyncio.ensure_future(post(s, url + "/generate", _body("held")))
            await asyncio.sleep(0.3)
            assert not held.done()
            await post(s, url + "/continue_generation", {})
            st, out = await asyncio.wait_for(held, 10)
            assert st == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
            assert router.proxy.stats.aborted_paused == 3
    finally:
        async with aiohttp.ClientSession() as s:  # the module's engine generates again
            await post(s, engine_url + "/continue_generation", {})
        await router.stop()


async def test_the_data_worker_pauses_promptly_however_close_a_dispatch_came_before(engine_url):
    """The run's turn, repeated: a batch completes (the worker dispatches the next samples at
    once), the worker pauses (abort through the router), the engines continue, the worker
    resumes. Before the fix about every other pause waited forever on samples dispatched just
    before it, held by the paused engine."""
    router, url = await _router(engine_url)
    client = GenerateClient(
        GenerateClientConfig(url=url, max_response_len=24, stop_token_ids=(EOS,)),
        num_layers=2,
        topk=2,
    )
    fam = TaskFamily(TaskFamilyConfig(seed=0))
    prompts = {}
    for i in range(100):
        p = task_prompt(fam.train_prompt(i), index=i)
        prompts.setdefault(p.key, p)
    cfg = DataWorkerConfig(
        n_samples_per_prompt=4,
        groups_per_step=2,
        max_staleness=1,
        fifo_window=4,
        default_expected_len=8,
    )
    s = aiohttp.ClientSession()

    async def abort_all() -> None:
        await post(s, url + "/pause_generation", {"mode": "abort"})

    worker = RolloutDataWorker(
        cfg, InMemoryPromptSource(list(prompts.values())), client, abort_fn=abort_all
    )
    await worker.start()
    try:
        for version in range(8):
            await worker.get_batch(2, current_version=version, timeout=30)
            await worker.pause(timeout=10)  # before the fix: held generations, a TimeoutError
            await post(s, url + "/continue_generation", {})
            worker.set_served_version(version + 1)
            await worker.resume()
        assert router.proxy.stats.failed == 0
        assert worker.metrics()["data/aborted"] > 0  # the pauses did cut generations
    finally:
        await worker.stop()
        await client.close()
        await s.close()
        await router.stop()
