"""Sleep and wake of the embedded engine over real HTTP (SGLang's `/release_memory_occupation`
and `/resume_memory_occupation`): level 2 really returns the weights' memory to the OS (the
engine process's RSS, measured with psutil), generation after wake is bit-identical to before,
and SGLang's rules: a release needs an idle engine, a sleeping engine refuses generation and
weight updates, a tag that is not released cannot be resumed."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import psutil
import pytest
import torch

from slime_async.contracts.model import TINY_MOE
from slime_async.engine import EngineConfig, EngineProcess, EngineServer
from slime_async.engine.sleep import level_of, tags_for_level
from slime_async.engine.testing import post

pytestmark = pytest.mark.timeout(120)
BODY = {
    "input_ids": [[3, 1, 4, 1, 5], [2, 7, 1, 8]],
    "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7},
    "return_logprob": True,
}
# ~40 MB of fp32 weights, in tensors of every size (so the heap's small blocks count too)
SPEC = dataclasses.replace(
    TINY_MOE, vocab_size=8192, hidden_size=384, intermediate_size=768, moe_intermediate_size=384
)


def _answer(out: list[dict]) -> list[tuple]:
    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in out]


async def _info(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/server_info") as r:
        return (await r.json())["internal_states"][0]


def test_level2_sleep_frees_the_weights_and_wake_is_bit_identical(tmp_path) -> None:
    cfg = EngineConfig(dtype="fp32", model_spec=SPEC.to_dict(), num_threads=1)
    proc = EngineProcess(cfg, log_path=str(tmp_path / "engine.log"))
    url = proc.start()
    try:
        ps = psutil.Process(proc.proc.pid)

        async def run() -> None:
            async with aiohttp.ClientSession() as s:
                st, before = await post(s, url + "/generate", BODY)
                assert st == 200
                rss_awake = ps.memory_info().rss
                st, res = await post(s, url + "/release_memory_occupation", {"tags": None})
                assert (st, res) == (200, None)
                rss_asleep = ps.memory_info().rss
                mem = (await _info(s, url))["memory"]
                assert mem["sleep_level"] == 2 and mem["released_tags"] == [
                    "cuda_graph",
                    "kv_cache",
                    "weights",
                ]
                freed = mem["weights_bytes"]
                assert freed > 30e6
                # the process gave most of the weights' bytes back to the OS
                assert rss_awake - rss_asleep > 0.8 * freed, (rss_awake, rss_asleep, freed)
                st, res = await post(s, url + "/generate", BODY)
                assert st == 503 and "resume_memory_occupation" in res["error"]["message"]
                async with s.get(url + "/health_generate") as r:
                    assert r.status == 503
                async with s.get(url + "/health") as r:  # the process itself is alive
                    assert r.status == 200
                st, res = await post(s, url + "/resume_memory_occupation", {})
                assert (st, res) == (200, None)
                assert ps.memory_info().rss > rss_asleep + 0.8 * freed
                st, after = await post(s, url + "/generate", BODY)
                assert st == 200 and _answer(after) == _answer(before)

        asyncio.run(run())
    finally:
        proc.stop()


def test_an_idle_engine_gives_a_bursts_heap_back(tmp_path) -> None:
    """A burst of 64 concurrent requests grows the engine process's heap (KV, logits, the
    prefill's tensors); once the engine is idle its RSS is back within 60 MiB of where it was
    before the burst (the scheduler trims the heap when it goes idle; before: +145-180 MiB,
    kept until the process ended)."""
    proc = EngineProcess(EngineConfig(dtype="fp32", num_threads=1), log_path=str(tmp_path / "e"))
    url = proc.start()
    try:
        ps = psutil.Process(proc.proc.pid)

        async def gen(s: aiohttp.ClientSession, i: int, n: int, m: int) -> None:
            ids = [(7 * i + j) % 500 + 3 for j in range(n)]
            params = {"max_new_tokens": m, "temperature": 1.0, "ignore_eos": True}
            st, res = await post(
                s, url + "/generate", {"input_ids": ids, "sampling_params": params}
            )
            assert st == 200, res

        async def settled(limit: float) -> float:
            """RSS once at most `limit` (polled up to 5 s: the trim follows the last step)."""
            for _ in range(100):
                if (rss := ps.memory_info().rss) <= limit:
                    break
                await asyncio.sleep(0.05)
            return rss

        async def run() -> None:
            async with aiohttp.ClientSession() as s:
                await gen(s, 0, 20, 4)  # warm: the first forward's one-time allocations
                await asyncio.sleep(0.5)
                base = ps.memory_info().rss
                peak = 0
                burst = asyncio.ensure_future(
                    asyncio.gather(*(gen(s, i, 200, 48) for i in range(1, 65)))
                )
                while not burst.done():
                    peak = max(peak, ps.memory_info().rss)
                    await asyncio.sleep(0.02)
                await burst
                after = await settled(base + (60 << 20))
                mib = [round(x / 2**20) for x in (base, peak, after)]
                assert after <= base + (60 << 20), f"RSS before, peak, after: {mib} MiB"

        asyncio.run(run())
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    srv = EngineServer(EngineConfig(dtype="fp32", weight_version="0"))
    url = srv.start()
    yield url
    srv.stop()


async def test_release_needs_an_idle_engine_and_abort_all_makes_one(engine) -> None:
    url = engine
    long = {"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s:
        running = asyncio.ensure_future(post(s, url + "/generate", long))
        for _ in range(200):
            if not (await _info(s, url))["idle"]:
                break
            await asyncio.sleep(0.01)
        st, res = await post(s, url + "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert st == 400 and "no ongoing request" in res["error"]["message"]
        assert "abort_all" in res["error"]["message"]
        assert (await _info(s, url))["memory"]["sleep_level"] == 0  # nothing was released
        st, _ = await post(s, url + "/abort_request", {"abort_all": True})
        assert st == 200
        st, out = await running
        assert st == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await _info(s, url))["idle"] is True
        st, res = await post(s, url + "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert (st, res) == (200, None)
        st, _ = await post(s, url + "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert st == 200


async def test_level1_keeps_the_weights_and_drops_the_prefix_cache(engine) -> None:
    url = engine
    body = {**BODY, "input_ids": [list(range(10, 40))]}
    async with aiohttp.ClientSession() as s:
        _, before = await post(s, url + "/generate", body)
        _, again = await post(s, url + "/generate", body)
        assert again[0]["meta_info"]["cached_tokens"] > 0
        assert (await _info(s, url))["prefix_cache"]["tokens"] > 0
        st, _ = await post(s, url + "/release_memory_occupation", {"tags": tags_for_level(1)})
        info = await _info(s, url)
        assert st == 200 and info["memory"]["sleep_level"] == 1
        assert info["prefix_cache"]["tokens"] == 0
        st, _ = await post(s, url + "/generate", body)
        assert st == 503
        # weights stay resident at level 1: a weight update is allowed (selective sync)
        upd = {"new_version": "0", "abort_all_requests": False}
        st, _ = await post(s, url + "/update_weight_version", upd)
        assert st == 200
        st, _ = await post(s, url + "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert st == 200
        _, after = await post(s, url + "/generate", body)
        assert _answer(after) == _answer(before)
        assert after[0]["meta_info"]["cached_tokens"] == 0  # the cache really was dropped


async def test_bad_tags_resume_of_awake_tags_and_updates_while_released(engine, tmp_path) -> None:
    url = engine
    async with aiohttp.ClientSession() as s:
        st, res = await post(s, url + "/release_memory_occupation", {"tags": ["kv"]})
        assert st == 400 and "unknown memory tag" in res["error"]["message"]
        st, res = await post(s, url + "/resume_memory_occupation", {"tags": ["weights"]})
        assert st == 400 and "not released" in res["error"]["message"]
        st, _ = await post(s, url + "/release_memory_occupation", {"tags": tags_for_level(2)})
        assert st == 200
        upd = {"model_path": str(tmp_path), "weight_version": "9"}
        st, res = await post(s, url + "/update_weights_from_disk", upd)
        assert st == 400 and "resume them" in res["message"]
        st, _ = await post(s, url + "/resume_memory_occupation", None)  # null: all released
        assert st == 200 and (await _info(s, url))["memory"]["sleep_level"] == 0


def test_levels() -> None:
    assert level_of(set(tags_for_level(1))) == 1 and level_of(set(tags_for_level(2))) == 2
    with pytest.raises(ValueError, match="sleep level"):
        tags_for_level(3)


async def test_a_member_wakes_an_engine_a_push_left_paused_able_to_serve(engine, tmp_path) -> None:
    """A push pauses the engines in place and continues them through the router; an engine a
    pipeline put to sleep between the two (out of the router) missed the continue. Woken by
    `PipelineMember._wake` it serves again (it held every request before: the run starved)."""
    from types import SimpleNamespace

    from slime_async.config.pipeline import PipelineConfig
    from slime_async.orchestrator.pipeline_member import PipelineMember

    url = engine
    cluster = SimpleNamespace(asleep={url}, pending=set(), engine_urls=[url])
    run = SimpleNamespace(
        cfg=SimpleNamespace(
            pipeline=PipelineConfig(name="p"),
            run_dir=tmp_path,
            engine=SimpleNamespace(admin_api_key=None, api_key=None),
        ),
        cluster=cluster,
        supervisor=SimpleNamespace(behind=asyncio.Event()),
    )
    member = PipelineMember(run, level=2)
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url + "/pause_generation", {"mode": "in_place"}))[0] == 200
        tags = tags_for_level(2)
        assert (await post(s, url + "/release_memory_occupation", {"tags": tags}))[0] == 200
        await member._wake(url)
        assert url in cluster.pending and run.supervisor.behind.is_set()
        st, out = await asyncio.wait_for(post(s, url + "/generate", BODY), timeout=30)
        assert st == 200 and len(out) == 2
