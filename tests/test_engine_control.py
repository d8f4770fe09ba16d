"""The embedded engine's control plane over real HTTP: weight updates (and failed ones),
versions, abort, pause (abort / in_place / retract), flush, health, info, the model-dir and
subprocess launch paths."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from slime_async.contracts.model import ModelSpec
from slime_async.engine import EngineConfig, EngineProcess, EngineServer
from slime_async.engine.model import load_model
from slime_async.engine.testing import check_against_reference, post

pytestmark = pytest.mark.timeout(120)
LONG = {"max_new_tokens": 600, "ignore_eos": True}


def _save(dirpath: Path, *, seed: int, spec: dict | None = None, eos: int | None = None) -> str:
    lm = load_model(EngineConfig(dtype="fp32", seed=seed, model_spec=spec))
    if eos is not None:
        lm.model.config.eos_token_id = eos
    lm.model.save_pretrained(str(dirpath))
    return str(dirpath)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    cfg = EngineConfig(dtype="fp32", weight_version="0")
    srv = EngineServer(cfg)
    url = srv.start()
    yield url, cfg
    srv.stop()


async def _get(s: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with s.get(url) as r:
        return r.status, (await r.json() if r.content_type == "application/json" else {})


async def _wait_tokens(s: aiohttp.ClientSession, url: str, n: int) -> None:
    for _ in range(400):
        _, info = await _get(s, url + "/server_info")
        if info["internal_states"][0]["num_tokens"] >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("generation did not progress")


async def test_weight_update_changes_outputs_and_version(engine, tmp_path: Path) -> None:
    url, cfg = engine
    new_dir = _save(tmp_path / "w1", seed=1)
    body = {
        "input_ids": [3, 1, 4, 1, 5],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
        "return_logprob": True,
    }
    async with aiohttp.ClientSession() as s:
        _, before = await post(s, url + "/generate", body)
        assert before["meta_info"]["weight_version"] == "0"
        # a request in flight across the update (SGLang's sequence: pause in place, update
        # without a flush, continue) records both versions
        inflight = asyncio.ensure_future(
            post(s, url + "/generate", {"input_ids": [9, 9], "sampling_params": LONG})
        )
        await _wait_tokens(s, url, 50)
        await post(s, url + "/pause_generation", {"mode": "in_place"})
        upd = {"model_path": new_dir, "weight_version": "1", "flush_cache": False}
        st, res = await post(s, url + "/update_weights_from_disk", upd)
        await post(s, url + "/continue_generation", {})
        assert st == 200 and res["success"] is True, res
        _, after = await post(s, url + "/generate", body)
        _, info = await _get(s, url + "/model_info")
        _, crossing = await inflight
    assert after["meta_info"]["weight_version"] == "1" and info["weight_version"] == "1"
    assert after["output_ids"] != before["output_ids"]
    c = check_against_reference(
        load_model(EngineConfig(dtype="fp32", model_dir=new_dir)), body["input_ids"], after
    )
    assert c.logprob_abs_diff.max() < 1e-4  # served = the new weights
    spans = crossing["meta_info"]["weight_versions"]
    assert [sp["version"] for sp in spans] == ["0", "1"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == len(crossing["output_ids"]) == LONG["max_new_tokens"]
    assert crossing["meta_info"]["weight_version"] == "1"
    # restore the original weights for the other tests
    orig = _save(tmp_path / "w0", seed=cfg.seed)
    async with aiohttp.ClientSession() as s:
        st, res = await post(
            s, url + "/update_weights_from_disk", {"model_path": orig, "weight_version": "2"}
        )
        assert res["success"]
        _, back = await post(s, url + "/generate", body)
    assert back["output_ids"] == before["output_ids"]


async def test_failed_weight_update_keeps_old_weights(engine, tmp_path: Path) -> None:
    url, _ = engine
    wrong = _save(tmp_path / "wrong", seed=0, spec=ModelSpec(hidden_size=64, head_dim=16).to_dict())
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{not json")
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"garbage")
    body = {"input_ids": [2, 7, 1, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    async with aiohttp.ClientSession() as s:
        _, before = await post(s, url + "/generate", body)
        _, info0 = await _get(s, url + "/model_info")
        for path, needle in [
            (str(tmp_path / "nope"), "not a directory"),
            (wrong, "do not fit"),
            (str(tmp_path / "junk"), "could not load"),
        ]:
            st, res = await post(
                s, url + "/update_weights_from_disk", {"model_path": path, "weight_version": "99"}
            )
            assert st == 400 and res["success"] is False and needle in res["message"], res
        _, after = await post(s, url + "/generate", body)
        _, info1 = await _get(s, url + "/model_info")
    assert after["output_ids"] == before["output_ids"]
    assert info1["weight_version"] == info0["weight_version"] != "99"


async def test_abort_request_returns_partial_output(engine) -> None:
    url, _ = engine
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(
            post(
                s,
                url + "/generate",
                {
                    "input_ids": [1, 2, 3],
                    "rid": "victim",
                    "sampling_params": LONG,
                    "return_logprob": True,
                    "return_routed_experts": True,
                },
            )
        )
        await _wait_tokens(s, url, 30)
        st, _ = await post(s, url + "/abort_request", {"rid": "victim"})
        assert st == 200
        st, ans = await asyncio.wait_for(task, 10)
    meta = ans["meta_info"]
    assert st == 200 and meta["finish_reason"]["type"] == "abort"
    n = len(ans["output_ids"])
    assert 0 < n < LONG["max_new_tokens"] and meta["completion_tokens"] == n
    assert len(meta["output_token_logprobs"]) == n
    from slime_async.contracts.rollout import decode_routed_experts

    assert decode_routed_experts(meta["routed_experts"], num_layers=2, topk=2).shape[0] == 3 + n - 1


async def test_pause_abort_mode_and_blocking_until_continue(engine) -> None:
    url, _ = engine
    async with aiohttp.ClientSession() as s:
        running = asyncio.ensure_future(
            post(s, url + "/generate", {"input_ids": [4, 4], "sampling_params": LONG})
        )
        await _wait_tokens(s, url, 20)
        st, res = await post(s, url + "/pause_generation", {"mode": "abort"})
        assert st == 200 and res["status"] == "ok"
        _, partial = await asyncio.wait_for(running, 10)
        assert partial["meta_info"]["finish_reason"]["type"] == "abort"
        queued = asyncio.ensure_future(
            post(s, url + "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
        )
        await asyncio.sleep(0.3)
        assert not queued.done(), "a request sent while paused must wait for continue"
        st, _ = await post(s, url + "/flush_cache", {})
        assert st == 400  # a queued request exists
        await post(s, url + "/continue_generation", {})
        st, ans = await asyncio.wait_for(queued, 10)
        assert st == 200 and len(ans["output_ids"]) == 2
        async with s.post(url + "/flush_cache") as r:
            assert r.status == 200 and "Cache flushed" in await r.text()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_keeps_requests_and_resumes_them(engine, mode: str) -> None:
    url, cfg = engine
    body = {
        "input_ids": [6, 5, 4],
        "sampling_params": {"max_new_tokens": 160, "ignore_eos": True, "sampling_seed": 3},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(post(s, url + "/generate", body))
        await _wait_tokens(s, url, 40)
        await post(s, url + "/pause_generation", {"mode": mode})
        _, i1 = await _get(s, url + "/server_info")
        await asyncio.sleep(0.3)
        _, i2 = await _get(s, url + "/server_info")
        assert (
            i1["internal_states"][0]["decoded_tokens"] == i2["internal_states"][0]["decoded_tokens"]
        )
        assert not task.done()
        await post(s, url + "/continue_generation", {})
        st, ans = await asyncio.wait_for(task, 20)
        _, alone = await post(s, url + "/generate", body)
    assert st == 200 and ans["meta_info"]["finish_reason"] == {"type": "length", "length": 160}
    assert ans["output_ids"] == alone["output_ids"]  # same seed: pausing changed nothing
    c = check_against_reference(load_model(cfg), body["input_ids"], ans)
    assert c.logprob_abs_diff.max() < 1e-4 and bool(c.routed_equal.all())


async def test_update_weight_version_aborts_by_default(engine) -> None:
    url, _ = engine
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(
            post(s, url + "/generate", {"input_ids": [8], "sampling_params": LONG})
        )
        await _wait_tokens(s, url, 10)
        st, res = await post(s, url + "/update_weight_version", {"new_version": "7"})
        assert st == 200 and res == {"success": True, "message": res["message"], "new_version": "7"}
        _, ans = await asyncio.wait_for(task, 10)
        assert ans["meta_info"]["finish_reason"]["type"] == "abort"
        keep = asyncio.ensure_future(
            post(
                s, url + "/generate", {"input_ids": [8], "sampling_params": {"max_new_tokens": 200}}
            )
        )
        await _wait_tokens(s, url, 10)
        _, res2 = await post(
            s, url + "/update_weight_version", {"new_version": "8", "abort_all_requests": False}
        )
        assert res2["success"] and res2["new_version"] == "8"
        _, kept = await asyncio.wait_for(keep, 20)
        assert kept["meta_info"]["finish_reason"]["type"] == "length"
        assert kept["meta_info"]["weight_version"] == "8"
        _, ans2 = await post(
            s, url + "/generate", {"input_ids": [8], "sampling_params": {"max_new_tokens": 1}}
        )
    assert ans2["meta_info"]["weight_version"] == "8"


async def test_health_info_and_load_routes(engine) -> None:
    url, _ = engine
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/health_generate", "/ready"):
            async with s.get(url + path) as r:
                assert r.status == 200, path
        _, mi = await _get(s, url + "/model_info")
        _, mi2 = await _get(s, url + "/get_model_info")
        assert mi == mi2 and mi["is_generation"] is True and mi["model_type"] == "qwen3_moe"
        _, si = await _get(s, url + "/server_info")
        _, si2 = await _get(s, url + "/get_server_info")
        assert si["dtype"] == "fp32" and si2["version"] == si["version"]
        async with s.get(url + "/get_load") as r:
            load = await r.json()
        assert load[0]["num_reqs"] == 0 and "num_tokens" in load[0]
        async with s.post(url + "/release_memory_occupation", json={}) as r:
            assert r.status == 200
        async with s.post(url + "/resume_memory_occupation", json={}) as r:
            assert r.status == 200  # asleep in between (tests/test_engine_sleep.py)


async def test_model_dir_engine_stops_on_eos(tmp_path: Path) -> None:
    """Load a checkpoint directory; the config's eos_token_id ends generation unless ignore_eos."""
    probe = load_model(EngineConfig(dtype="fp32", seed=3))
    p = [10, 20, 30]
    greedy = probe.model(input_ids=torch.tensor([p])).logits[0, -1].argmax().item()
    model_dir = _save(tmp_path / "ckpt", seed=3, eos=int(greedy))
    srv = EngineServer(EngineConfig(dtype="fp32", model_dir=model_dir))
    url = srv.start()
    try:
        async with aiohttp.ClientSession() as s:
            sp = {"max_new_tokens": 5, "temperature": 0.0}
            _, stop = await post(s, url + "/generate", {"input_ids": p, "sampling_params": sp})
            _, cont = await post(
                s,
                url + "/generate",
                {"input_ids": p, "sampling_params": {**sp, "ignore_eos": True}},
            )
            _, mi = await _get(s, url + "/model_info")
    finally:
        srv.stop()
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": greedy}
    assert stop["output_ids"] == [greedy] and stop["text"] == ""
    assert len(cont["output_ids"]) == 5 and mi["model_path"] == model_dir


def test_subprocess_launcher_serves_and_stops() -> None:
    proc = EngineProcess(
        EngineConfig(dtype="bf16", weight_version="3"), extra_args=["--num-threads", "1"]
    )
    url = proc.start(timeout=90)
    try:
        import json
        import urllib.request

        req = urllib.request.Request(
            url + "/generate",
            data=json.dumps(
                {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}
            ).encode(),
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            ans = json.loads(r.read())
        assert len(ans["output_ids"]) == 4 and ans["meta_info"]["weight_version"] == "3"
    finally:
        proc.stop()
    assert proc.proc is not None and proc.proc.returncode == 0


async def test_client_disconnect_and_group_abort_free_the_batch(engine) -> None:
    url, _ = engine
    async with aiohttp.ClientSession() as s:
        # a client that gives up: its request leaves the batch instead of running 600 tokens
        timeout = aiohttp.ClientTimeout(total=0.5)
        with pytest.raises(asyncio.TimeoutError):
            await s.post(
                url + "/generate",
                json={"input_ids": [3, 3], "sampling_params": LONG},
                timeout=timeout,
            )
        for _ in range(100):
            _, info = await _get(s, url + "/server_info")
            if info["internal_states"][0]["num_reqs"] == 0:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("a disconnected client's request kept running")
        # /abort_request with a batch request's rid aborts all its items, and only those
        batch = asyncio.ensure_future(
            post(
                s,
                url + "/generate",
                {"input_ids": [[1], [2]], "rid": "job", "sampling_params": LONG},
            )
        )
        other = asyncio.ensure_future(
            post(
                s,
                url + "/generate",
                {"input_ids": [4], "rid": "job_x", "sampling_params": {"max_new_tokens": 120}},
            )
        )
        await _wait_tokens(s, url, 20)
        await post(s, url + "/abort_request", {"rid": "job"})
        _, items = await asyncio.wait_for(batch, 10)
        _, kept = await asyncio.wait_for(other, 30)
    assert [it["meta_info"]["finish_reason"]["type"] for it in items] == ["abort", "abort"]
    assert [it["meta_info"]["id"] for it in items] == ["job_0", "job_1"]
    assert kept["meta_info"]["finish_reason"]["type"] == "length"


async def test_failed_model_step_is_a_500_and_the_engine_recovers(engine, monkeypatch) -> None:
    from slime_async.engine import batch

    url, _ = engine
    real = batch.decode
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(batch, "decode", flaky)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 20}}
    async with aiohttp.ClientSession() as s:
        st, err = await post(s, url + "/generate", body)
        assert st == 500 and "injected step failure" in err["error"]["message"]
        st, ok = await post(s, url + "/generate", body)
        assert st == 200 and len(ok["output_ids"]) == 20
        calls["n"] = 0  # mid-stream failure: an SSE error event, then [DONE]
        async with s.post(url + "/generate", json={**body, "stream": True}) as r:
            lines = [ln.decode().strip() async for ln in r.content if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "injected step failure" in lines[-2]


async def test_failure_while_admitting_a_prefill_answers_its_rows(engine, monkeypatch) -> None:
    """A step that fails after the prefill forward, while its rows join the running batch,
    answers those rows with a 500 (they used to be in neither the queue nor the batch then, so
    their clients waited forever); the engine serves the next request."""
    from slime_async.engine import batch

    url, _ = engine
    real = batch.merge
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected merge failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(batch, "merge", flaky)
    body = {"input_ids": [7, 2, 9], "sampling_params": {"max_new_tokens": 4, "n": 2}}
    async with aiohttp.ClientSession() as s:
        st, err = await asyncio.wait_for(post(s, url + "/generate", body), 30)
        assert st == 500 and "injected merge failure" in err["error"]["message"], err
        st, ok = await asyncio.wait_for(post(s, url + "/generate", body), 30)
    assert st == 200 and [len(o["output_ids"]) for o in ok] == [4, 4], ok


async def test_health_generate_counts_any_output_as_sglang_does() -> None:
    """SGLang's `/health_generate` answers 200 once its scheduler produces any output: an engine
    busy with a queue deeper than the probe's timeout is healthy. Its own 1-token request would
    wait behind the queue (one running request at a time here) past the timeout."""
    import time

    from slime_async.engine import EngineConfig, EngineServer

    srv = EngineServer(
        EngineConfig(dtype="fp32", seed=1, max_running_requests=1, health_generate_timeout_s=1.0)
    )
    url = srv.start()
    try:
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 400}}
            busy = [asyncio.ensure_future(post(s, url + "/generate", body)) for _ in range(4)]
            await asyncio.sleep(0.5)  # the first is decoding, three wait
            t0 = time.monotonic()
            async with s.get(url + "/health_generate") as r:
                assert r.status == 200
            assert time.monotonic() - t0 < 1.0
            for f in busy:
                f.cancel()
    finally:
        srv.stop()
