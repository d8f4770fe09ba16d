"""One client's bad request never hurts another's (issue 17, High/Medium), against the real engine.

Each test sends the bad input to a real embedded engine over HTTP (or, for the batch-isolation
case, puts a malformed sequence into the real scheduler next to honest HTTP requests) and checks
both the bad request's answer and that every honest request in the same batch still finishes.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.testing import post

pytestmark = pytest.mark.timeout(180)

HONEST = {"input_ids": [1, 5, 9, 3], "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}


@pytest.fixture(scope="module")
def engine():
    srv = EngineServer(
        EngineConfig(dtype="fp32", seed=1, weight_version="0", max_running_requests=16)
    )
    srv.start()
    yield srv
    srv.stop()


async def _load(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/get_load") as r:
        return (await r.json())[0]


async def _honest_in_batch(s: aiohttp.ClientSession, url: str, honest: int) -> list:
    """Start `honest` honest requests; return their tasks once all their rows are in the batch.

    On a loaded machine the rows may never be in the batch together (the first can finish its
    tokens before the last arrives): a round whose rows finish before that is seen is run
    again. (Waiting on the load alone once waited forever in a full-suite run.)"""
    for _ in range(5):
        tasks = [asyncio.ensure_future(post(s, url + "/generate", HONEST)) for _ in range(honest)]
        while (await _load(s, url))["num_reqs"] < honest and not any(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        if not any(t.done() for t in tasks):
            return tasks
        await asyncio.gather(*tasks)
    raise AssertionError(f"the {honest} honest requests were never in the batch together")


async def _honest_and_bad(url: str, bad: dict, *, honest: int = 4) -> tuple[list, tuple]:
    """`honest` honest requests in flight, then `bad` while they all decode; all answers."""
    async with aiohttp.ClientSession() as s:
        tasks = await _honest_in_batch(s, url, honest)
        bad_answer = await post(s, url + "/generate", bad)
        return await asyncio.gather(*tasks), bad_answer


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"stop_token_ids": [10**30], "min_new_tokens": 2}, "stop_token_ids"),
        ({"stop_token_ids": [1 << 20], "min_new_tokens": 2}, "stop_token_ids"),
        ({"stop_token_ids": [-1], "min_new_tokens": 2}, "stop_token_ids"),
        ({"sampling_seed": 2**64}, "sampling_seed"),
        ({"sampling_seed": -1}, "sampling_seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
    ],
)
async def test_bad_sampling_field_is_a_400_naming_it_and_the_batch_finishes(engine, params, names):
    bad = {"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 8, **params}}
    honest, (status, body) = await _honest_and_bad(engine.url, bad)
    assert status == 400, body
    assert names in body["error"]["message"]
    for st, ans in honest:
        assert st == 200, ans
        assert len(ans["output_ids"]) == 24


async def test_seed_overflow_with_n_leaves_no_orphan_generation(engine):
    """n = 2 from seed 2^64 - 1: the second sample's seed overflows. The request is refused
    whole, before anything is queued (it used to start the first sample and answer 500)."""
    body = {
        "input_ids": [1, 5],
        "sampling_params": {"n": 2, "sampling_seed": 2**64 - 1, "max_new_tokens": 4},
    }
    async with aiohttp.ClientSession() as s:
        status, ans = await post(s, engine.url + "/generate", body)
        assert status == 400 and "sampling_seed" in ans["error"]["message"]
        load = await _load(s, engine.url)
    assert load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0


async def test_json_nan_literal_is_refused_with_a_400(engine):
    raw = b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}'
    async with aiohttp.ClientSession() as s:
        status, ans = await post(s, engine.url + "/generate", raw=raw)
    assert status == 400 and "temperature" in ans["error"]["message"]


async def test_a_row_that_fails_in_the_shared_step_fails_alone(engine):
    """Isolation inside the batch, past validation: a sequence whose sampling raises (here an
    out-of-vocabulary banned id placed directly into the scheduler, as a validation gap would)
    finishes with an error of its own; the honest rows decoding with it all finish."""
    import dataclasses

    from slime_async.engine.protocol import GenerateItem, GenerateRequest
    from slime_async.engine.sampling import SamplingParams

    eng, loop = engine.engine, engine._loop
    item = GenerateItem(
        rid="poison",
        group_rid="poison",
        prompt=[1, 2, 3],
        params=dataclasses.replace(
            SamplingParams(max_new_tokens=8, min_new_tokens=4), stop_token_ids=frozenset({10**30})
        ),
        return_logprob=False,
        logprob_start_len=-1,
        return_text_in_logprobs=False,
        return_routed_experts=False,
        routed_start=0,
    )

    async def submit_poison():
        (seq,) = eng.submit(GenerateRequest(items=[item], batch=False, stream=False))
        await seq.done.wait()
        return seq.finish_reason

    async with aiohttp.ClientSession() as s:
        tasks = await _honest_in_batch(s, engine.url, 4)
        reason = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(submit_poison(), loop))
        honest = await asyncio.gather(*tasks)
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert "sampling" in reason["message"]
    for st, ans in honest:
        assert st == 200, ans
        assert ans["meta_info"]["finish_reason"]["type"] == "length"
        assert len(ans["output_ids"]) == 24
