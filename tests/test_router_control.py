"""Control fan-out, weight catch-up on re-admission, auth, CLI and the threaded runner,
against real HTTP engines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from router import FanoutError, Router, RouterClient, RouterConfig, RouterThread
from router.testing import EngineProcess, FakeEngine, FakeEngineConfig
from router.workers import WorkerState

pytestmark = pytest.mark.timeout(60)


async def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _engines(n: int) -> list[FakeEngine]:
    engines = [FakeEngine(FakeEngineConfig(name=f"e{i}", step_s=0.001)) for i in range(n)]
    for e in engines:
        await e.start()
    return engines


async def test_fanout_reports_each_engine_and_quarantines_the_dead_one() -> None:
    engines = await _engines(2)
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    router = Router(
        RouterConfig(worker_urls=(*[e.url for e in engines], dead), health_interval_s=5.0)
    )
    url = await router.start()
    try:
        await _wait(lambda: len(router.registry.healthy()) == 2)
        dw = router.registry.find_url(dead)
        router.registry.admit(dw)  # pretend it was healthy until now
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/pause_generation", json={"mode": "abort"})
            assert r.status == 207
            reply = await r.json()
        assert reply["total"] == 3 and reply["succeeded"] == 2
        assert [f["url"] for f in reply["failed"]] == [dead]
        assert reply["failed"][0]["quarantined"] is True and reply["failed"][0]["status"] is None
        assert dw.state is WorkerState.QUARANTINED
        for e in engines:
            res = reply["results"][router.registry.find_url(e.url).id]
            assert res["success"] and res["status"] == 200 and res["body"]["status"] == "ok"
            assert e.control_calls == [("/pause_generation", {"mode": "abort"})]
        async with RouterClient(url) as rc:
            with pytest.raises(FanoutError, match=dead):
                await rc.fan_out("/continue_generation", {}, strict=True)
            reply = await rc.continue_generation()  # the dead engine is quarantined: no raise
            assert reply["succeeded"] == 2 and reply["failed"][0]["url"] == dead
            assert all(not e.paused for e in engines)
    finally:
        await router.stop()
        for e in engines:
            await e.stop()


async def test_weight_update_versions_every_engine_and_catches_up_a_restarted_one() -> None:
    engines = await _engines(2)
    late = EngineProcess.spawn(count=1, name="late", step_s=0.001)
    late_url = late.urls[0]
    router = Router(
        RouterConfig(worker_urls=(*[e.url for e in engines], late_url), health_interval_s=0.1)
    )
    url = await router.start()
    restarted = None
    try:
        await _wait(lambda: len(router.registry.healthy()) == 3)
        late.kill()  # crashes before the weight update
        async with RouterClient(url) as rc, aiohttp.ClientSession() as s:
            async with rc.paused():
                reply = await rc.update_weights_from_disk("/ckpt/v7", weight_version=7)
            assert [f["url"] for f in reply["failed"]] == [late_url] and reply["succeeded"] == 2
            assert router.registry.find_url(late_url).state is WorkerState.QUARANTINED
            assert all(e.weight_version == "7" and not e.paused for e in engines)
            for _ in range(4):
                body = await (await s.post(url + "/generate", json={"text": "x"})).json()
                assert body["meta_info"]["weight_version"] == "7"

            # The engine comes back with its initial weights: re-admitted only after the router
            # replays the update it missed.
            port = int(late_url.rsplit(":", 1)[1])
            restarted = EngineProcess.spawn(ports=[port], name="late2", step_s=0.001)
            lw = router.registry.find_url(late_url)
            await _wait(lambda: lw.state is WorkerState.HEALTHY)
            info = await (await s.get(late_url + "/get_model_info")).json()
            assert info["weight_version"] == "7"
            versions = set()
            for _ in range(9):
                body = await (await s.post(url + "/generate", json={"text": "x"})).json()
                versions.add((body["meta_info"]["engine"], body["meta_info"]["weight_version"]))
            assert ("late2", "7") in versions and {v for _, v in versions} == {"7"}
    finally:
        await router.stop()
        for e in engines:
            await e.stop()
        late.kill()
        if restarted is not None:
            restarted.kill()


async def _model_version(s: aiohttp.ClientSession, url: str) -> str:
    return (await (await s.get(url + "/get_model_info")).json())["weight_version"]


@pytest.mark.parametrize("missed_a_push", [True, False])
async def test_an_engine_restarted_at_its_url_is_readmitted_on_the_newest_weights(
    missed_a_push: bool,
) -> None:
    """The only engine dies. Either a push happens while it is down (it reaches no engine, yet
    it is what the fleet must serve), or none does (the restarted process still lost v1). The
    process that comes back at the same URL is re-admitted only after the newest weights are
    replayed on it."""
    only = EngineProcess.spawn(count=1, name="first", step_s=0.001)
    wurl = only.urls[0]
    router = Router(RouterConfig(worker_urls=(wurl,), health_interval_s=0.1))
    url = await router.start()
    restarted = None
    try:
        await _wait(lambda: len(router.registry.healthy()) == 1)
        w = router.registry.find_url(wurl)
        async with RouterClient(url) as rc, aiohttp.ClientSession() as s:
            await rc.update_weights_from_disk("/ckpt/v1", weight_version=1)
            only.kill()
            await _wait(lambda: w.state is WorkerState.QUARANTINED)
            newest = "1"
            if missed_a_push:
                with pytest.raises(FanoutError, match="0/1 engines succeeded"):
                    await rc.update_weights_from_disk("/ckpt/v2", weight_version=2)
                newest = "2"
            assert router.registry.weight_generation == int(newest)
            port = int(wurl.rsplit(":", 1)[1])
            restarted = EngineProcess.spawn(ports=[port], name="second", step_s=0.001)
            await _wait(lambda: w.state is WorkerState.HEALTHY)
            assert await _model_version(s, wurl) == newest
            body = await (await s.post(url + "/generate", json={"text": "x"})).json()
            assert body["meta_info"]["weight_version"] == newest
    finally:
        await router.stop()
        only.kill()
        if restarted is not None:
            restarted.kill()


async def test_update_refused_by_every_engine_quarantines_none() -> None:
    engines = await _engines(2)
    router = Router(RouterConfig(worker_urls=tuple(e.url for e in engines), health_interval_s=5))
    url = await router.start()
    try:
        await _wait(lambda: len(router.registry.healthy()) == 2)
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/update_weights_from_disk", json={"model_path": "/missing"})
            assert r.status == 207
            reply = await r.json()
            assert reply["succeeded"] == 0 and len(reply["failed"]) == 2
            assert len(router.registry.healthy()) == 2 and router.registry.weight_generation == 0
            async with RouterClient(url) as rc:
                with pytest.raises(FanoutError, match="0/2 engines succeeded"):
                    await rc.update_weights_from_disk("/missing/v1", weight_version=1)
            r = await s.post(url + "/update_weights_from_disk", json={"weight_version": "1"})
            assert r.status == 400 and "model_path" in (await r.json())["error"]["message"]
            r = await s.post(url + "/update_weight_version", data=b"[]")
            assert r.status == 400
            for path in ("/flush_cache", "/abort_request"):
                r = await s.post(url + path, json={"abort_all": True} if "abort" in path else {})
                assert r.status == 200 and (await r.json())["succeeded"] == 2
            r = await s.get(url + "/flush_cache")
            assert r.status == 200
            assert [c[0] for c in engines[0].control_calls][-3:] == [
                "/flush_cache",
                "/abort_request",
                "/flush_cache",
            ]
    finally:
        await router.stop()
        for e in engines:
            await e.stop()


async def test_keys_guard_management_control_and_data_routes() -> None:
    engines = await _engines(1)
    router = Router(
        RouterConfig(worker_urls=(engines[0].url,), api_key="d4ta", admin_api_key="s3cret")
    )
    url = await router.start()
    try:
        await _wait(lambda: len(router.registry.healthy()) == 1)
        async with aiohttp.ClientSession() as s:
            for method, path in [
                ("GET", "/workers"),
                ("POST", "/workers"),
                ("POST", "/pause_generation"),
                ("POST", "/update_weights_from_disk"),
            ]:
                for token in (None, "nope", "d4ta"):  # the data-plane key changes nothing
                    auth = {"Authorization": f"Bearer {token}"} if token else {}
                    r = await s.request(method, url + path, json={}, headers=auth)
                    assert r.status == 401, (path, token)
                    assert "admin key" in (await r.json())["error"]["message"]
            assert engines[0].control_calls == []
            # the data plane needs the data-plane key, on loopback too
            assert (await s.post(url + "/generate", json={"text": "x"})).status == 401
            data = {"Authorization": "Bearer d4ta"}
            assert (await s.post(url + "/generate", json={"text": "x"}, headers=data)).status == 200
        async with RouterClient(url, token="s3cret") as rc:
            assert len(await rc.list_workers()) == 1
            assert (await rc.flush_cache())["succeeded"] == 1
    finally:
        await router.stop()
        await engines[0].stop()


def test_cli_refuses_non_loopback_without_token_and_serves_on_loopback() -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    bad = subprocess.run(
        [sys.executable, "-m", "router", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert bad.returncode == 2 and "--auth-token" in bad.stderr

    engines = EngineProcess.spawn(count=1, name="cli")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "--port", "0", "--worker-urls", engines.urls[0]],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert "router listening on http://127.0.0.1:" in line
        url = line.split()[3]
        deadline = time.monotonic() + 10
        while True:
            try:  # /health is 503 until the engine is admitted
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if json.load(r)["healthy_workers"] == 1:
                        break
            except urllib.error.HTTPError as e:
                assert e.code == 503

            assert time.monotonic() < deadline
            time.sleep(0.05)
        req = urllib.request.Request(
            url + "/generate", data=b'{"text": "x"}', headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["meta_info"]["engine"] == "cli"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        engines.kill()


def test_threaded_runner_for_synchronous_callers() -> None:
    engines = EngineProcess.spawn(count=1, name="sync")
    rt = RouterThread(RouterConfig(worker_urls=tuple(engines.urls), health_interval_s=0.1))
    try:
        url = rt.start()
        deadline = time.monotonic() + 10
        while not rt.router.registry.healthy():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        req = urllib.request.Request(
            url + "/generate",
            data=b'{"text": "x", "sampling_params": {"max_new_tokens": 3}}',
            headers={"Content-Type": "application/json", "X-Expected-Tokens": "3"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["meta_info"]["completion_tokens"] == 3
    finally:
        rt.stop()
        engines.kill()


def test_a_fanout_to_no_engine_says_so() -> None:
    e = FanoutError("/pause_generation", {"total": 0, "succeeded": 0, "failed": []})
    assert str(e) == "/pause_generation: no engine is registered with the router (none to call)"
    e = FanoutError(
        "/pause_generation",
        {"total": 2, "succeeded": 1, "failed": [{"url": "http://a:1", "error": "HTTP 500"}]},
    )
    assert str(e) == "/pause_generation: 1/2 engines succeeded; failed: http://a:1 (HTTP 500)"
