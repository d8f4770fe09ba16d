"""SGLang's locking rules on the embedded engine, over real HTTP (docs/weight-sync.md).

Every running `/generate` reads the model; an update while generation is not paused waits for
the writer side (the running requests finish first, on the old weights); after a pause the
update runs at once, and `flush_cache: true` (the default) is refused while requests are in the
engine. The push that keeps requests alive, pause in place -> update without a flush ->
continue, passes, through the router too (`DiskTransport.push`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from router import Router, RouterClient, RouterConfig
from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.model import load_model
from slime_async.engine.testing import check_against_reference, post
from slime_async.weights import DiskTransport

pytestmark = pytest.mark.timeout(240)
LONG = {"max_new_tokens": 300, "ignore_eos": True}
PROMPT = {
    "input_ids": [3, 1, 4, 1, 5],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
    "return_logprob": True,
}


def _save(d: Path, *, seed: int) -> str:
    load_model(EngineConfig(dtype="fp32", seed=seed)).model.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("locking")
    dirs = {"orig": _save(root / "w0", seed=0), "new": _save(root / "w1", seed=1)}
    srv = EngineServer(EngineConfig(dtype="fp32", weight_version="0", seed=0))
    url = srv.start()
    yield url, dirs
    srv.stop()


async def _state(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/server_info") as r:
        return (await r.json())["internal_states"][0]


async def _until(s: aiohttp.ClientSession, url: str, cond) -> None:
    for _ in range(2000):
        if cond(await _state(s, url)):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("engine never reached the expected state")


async def _restore(s: aiohttp.ClientSession, url: str, dirs: dict, version: str = "0") -> None:
    body = {"model_path": dirs["orig"], "weight_version": version}
    st, res = await post(s, url + "/update_weights_from_disk", body)
    assert st == 200 and res["success"], res


def _versions(answer: dict) -> list[str]:
    spans = answer["meta_info"].get("weight_versions") or []
    return [sp["version"] for sp in spans] or [answer["meta_info"]["weight_version"]]


async def test_unpaused_update_waits_for_running_requests(engine) -> None:
    """Drain, then swap: the running request finishes on the old weights, a request that
    arrives while the update waits runs after it, on the new ones."""
    url, dirs = engine
    async with aiohttp.ClientSession() as s:
        running = asyncio.ensure_future(
            post(s, url + "/generate", {"input_ids": [9, 9], "sampling_params": LONG})
        )
        await _until(s, url, lambda st: st["num_tokens"] >= 20)
        body = {"model_path": dirs["new"], "weight_version": "1"}  # flush_cache: default true
        update = asyncio.ensure_future(post(s, url + "/update_weights_from_disk", body))
        await _until(s, url, lambda st: st["model_lock_writers_waiting"] == 1)
        late = asyncio.ensure_future(post(s, url + "/generate", PROMPT))
        (st_r, r), (st_u, u), (st_l, lt) = await asyncio.gather(running, update, late)
        await _restore(s, url, dirs)
    assert st_u == 200 and u["success"], u
    assert st_r == 200 and _versions(r) == ["0"]  # never saw the new weights
    assert r["meta_info"]["completion_tokens"] == LONG["max_new_tokens"]  # not aborted
    assert st_l == 200 and _versions(lt) == ["1"]
    ref = load_model(EngineConfig(dtype="fp32", model_dir=dirs["new"]))
    assert check_against_reference(ref, PROMPT["input_ids"], lt).logprob_abs_diff.max() < 1e-4


async def test_paused_in_place_needs_flush_cache_false(engine) -> None:
    """After pause in place the update does not wait; with flush_cache true it is refused while
    the frozen request is in the engine (weights and version unchanged); with false it passes,
    and the request continues on the new weights, its tokens labelled 0 then 1."""
    url, dirs = engine
    async with aiohttp.ClientSession() as s:
        running = asyncio.ensure_future(
            post(s, url + "/generate", {"input_ids": [9, 9], "sampling_params": LONG})
        )
        await _until(s, url, lambda st: st["num_tokens"] >= 20)
        st, res = await post(s, url + "/pause_generation", {"mode": "in_place"})
        assert st == 200 and res["status"] == "ok"
        body = {"model_path": dirs["new"], "weight_version": "1"}
        st, refused = await post(s, url + "/update_weights_from_disk", body)
        assert st == 400 and refused["success"] is False
        assert "flush_cache" in refused["message"] and "in_place" in refused["message"]
        async with s.get(url + "/model_info") as r:
            assert (await r.json())["weight_version"] == "0"
        st, ok = await post(s, url + "/update_weights_from_disk", {**body, "flush_cache": False})
        assert st == 200 and ok["success"] and ok["num_paused_requests"] == 1, ok
        await post(s, url + "/continue_generation", {})
        st_r, r = await running
        await _restore(s, url, dirs)
    assert st_r == 200 and _versions(r) == ["0", "1"]
    spans = r["meta_info"]["weight_versions"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == len(r["output_ids"]) == LONG["max_new_tokens"]


async def test_retract_keeps_requests_in_engine_abort_empties_it(engine) -> None:
    """Retracted requests wait in the queue, so a flushing update is refused; after a pause
    with mode abort nothing is left and a flushing update passes."""
    url, dirs = engine
    body = {"model_path": dirs["new"], "weight_version": "1"}
    async with aiohttp.ClientSession() as s:
        running = asyncio.ensure_future(
            post(s, url + "/generate", {"input_ids": [9, 9], "sampling_params": LONG})
        )
        await _until(s, url, lambda st: st["num_tokens"] >= 20)
        await post(s, url + "/pause_generation", {"mode": "retract"})
        st, refused = await post(s, url + "/update_weights_from_disk", body)
        assert st == 400 and "flush_cache" in refused["message"]
        await post(s, url + "/pause_generation", {"mode": "abort"})
        _, r = await running
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await _state(s, url))["model_lock_readers"] == 0
        st, ok = await post(s, url + "/update_weights_from_disk", body)
        assert st == 200 and ok["success"], ok
        await post(s, url + "/continue_generation", {})
        _, after = await post(s, url + "/generate", PROMPT)
        await _restore(s, url, dirs)
    assert _versions(after) == ["1"]


async def test_update_from_tensor_is_refused_not_unpickled(engine) -> None:
    url, _ = engine
    async with aiohttp.ClientSession() as s:
        body = {"serialized_named_tensors": ["gASVAAAAAAAAAAB9lC4="], "flush_cache": False}
        st, res = await post(s, url + "/update_weights_from_tensor", body)
    assert st == 400 and res["success"] is False
    assert (
        "never unpickles" in res["message"] and "update_weights_from_distributed" in res["message"]
    )


class _Writer:
    """The trainer's side of the disk transport: writes an HF directory of fixed weights."""

    def __init__(self, seed: int) -> None:
        self.lm = load_model(EngineConfig(dtype="fp32", seed=seed))

    def save_weights(self, path: str | Path) -> Path:
        self.lm.model.save_pretrained(str(path))
        return Path(path)


async def test_disk_push_pauses_in_place_through_the_router(engine, tmp_path: Path) -> None:
    """`DiskTransport.push` through the router: a request in flight keeps going across the
    push and its tokens carry both versions (an unpaused update would have drained it)."""
    url, dirs = engine
    router = Router(RouterConfig(worker_urls=(url,), health_interval_s=5.0))
    rurl = await router.start()
    try:
        async with RouterClient(rurl) as rc, aiohttp.ClientSession() as s:
            transport = DiskTransport(tmp_path / "weights", trainer=_Writer(seed=1), control=rc)
            running = asyncio.ensure_future(
                post(s, rurl + "/generate", {"input_ids": [9, 9], "sampling_params": LONG})
            )
            await _until(s, url, lambda st: st["num_tokens"] >= 20)
            metrics = await transport.push(1)
            st_r, r = await running
            st_info = await _state(s, url)
            await _restore(s, url, dirs)
    finally:
        await router.stop()
    assert metrics["weights/push_failed_engines"] == 0.0
    assert st_r == 200 and _versions(r) == ["0", "1"]
    assert r["meta_info"]["completion_tokens"] == LONG["max_new_tokens"]
    assert st_info["generation_paused"] is False  # continued after the push
