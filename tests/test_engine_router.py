"""Two embedded engines behind the real `sglang-router` binary (PyPI sglang-router 0.3.2):
the router registers them (probing /health, /get_model_info, /get_server_info) and
/generate requests flow through it with SGLang's response shape intact."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
import torch

from slime_async.contracts.rollout import decode_routed_experts
from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.testing import post

pytestmark = pytest.mark.timeout(120)
sglang_router = pytest.importorskip("sglang_router", reason="sglang-router wheel not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    servers = [
        EngineServer(
            EngineConfig(dtype="fp32", weight_version="5", always_return_routed_experts=True)
        )
        for _ in range(2)
    ]
    urls = [s.start() for s in servers]
    yield urls, servers
    for s in servers:
        s.stop()


def _launch(urls: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    cmd += ["--log-level", "warn"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def router(engines):
    urls, _ = engines
    proc, url = _launch(urls)
    try:
        deadline = time.monotonic() + 60
        while True:  # ready when both workers are registered and healthy
            if proc.poll() is not None:  # lost the port race: try another port, once
                proc, url = _launch(urls)
                if time.monotonic() > deadline - 30:
                    raise RuntimeError(f"sglang-router exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/workers", timeout=2) as r:
                    ws = json.loads(r.read())["workers"]
                if len(ws) == 2 and all(w["is_healthy"] for w in ws):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("sglang-router did not register both engines in 60s")
            time.sleep(0.2)
        yield url
    finally:  # the router renames itself `sglang::router`: stop it by PID only
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def test_generate_through_sglang_router(engines, router) -> None:
    _, servers = engines
    before = [s.engine.scheduler.steps for s in servers]
    body = {
        "input_ids": [1, 2, 3, 4],
        "sampling_params": {"max_new_tokens": 6},
        "return_logprob": True,
        "return_routed_experts": True,
    }
    async with aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(post(s, router + "/generate", body) for _ in range(8)))
    for status, ans in answers:
        assert status == 200, ans
        meta = ans["meta_info"]
        assert len(ans["output_ids"]) == 6 and meta["finish_reason"]["type"] == "length"
        assert meta["weight_version"] == "5"
        assert [e[1] for e in meta["output_token_logprobs"]] == ans["output_ids"]
        # the stock router re-serialises requests and drops `return_routed_experts` (slime
        # uses a fork for R3); engines started with always_return_routed_experts still send
        # them, and the router passes the response's meta_info through untouched
        routed = decode_routed_experts(meta["routed_experts"], num_layers=2, topk=2)
        assert routed.shape == (4 + 6 - 1, 2, 2)
    after = [s.engine.scheduler.steps for s in servers]
    assert all(a > b for a, b in zip(after, before)), "round robin should use both engines"


async def test_router_info_and_malformed_passthrough(engines, router) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(router + "/get_model_info") as r:
            assert r.status == 200
            assert (await r.json())["model_type"] == "qwen3_moe"
        # the router re-serialises sampling_params (unknown keys vanish), but an engine's
        # 400 for a bad token id reaches the client as a 400
        status, body = await post(s, router + "/generate", {"input_ids": [1, 99999]})
    assert status == 400, body
