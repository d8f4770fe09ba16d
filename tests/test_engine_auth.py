"""The shared token on the real embedded engine and the real router: every engine route needs it
(constant-time compare), off loopback nothing starts without it, it never travels on a command
line, and the router presents it to the engines behind it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from router.config import AUTH_TOKEN_ENV, RouterConfig, add_router_args, router_config_from_args
from router.server import Router
from slime_async.engine import EngineConfig, EngineProcess, EngineServer

pytestmark = pytest.mark.timeout(180)
TOKEN = "tok-" + "x" * 28
GEN = {"input_ids": [3, 1, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    srv = EngineServer(EngineConfig(dtype="fp32", auth_token=TOKEN))
    yield srv.start()
    srv.stop()


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token is not None else {}


async def _status(url: str, method: str, path: str, token: str | None, body=None) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url + path, json=body, headers=_auth(token)) as r,
    ):
        await r.read()
        return r.status


ROUTES = [
    ("GET", "/health", None),
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
    ("POST", "/generate", GEN),
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/flush_cache", None),
    ("POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
async def test_every_route_refuses_a_missing_or_wrong_token(engine, method, path, body) -> None:
    assert await _status(engine, method, path, None, body) == 401
    assert await _status(engine, method, path, TOKEN[:-1] + "y", body) == 401
    assert await _status(engine, method, path, "", body) == 401


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
async def test_every_route_answers_the_right_token(engine, method, path, body) -> None:
    assert await _status(engine, method, path, TOKEN, body) == 200


def test_off_loopback_without_a_token_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=AUTH_TOKEN_ENV) as e:
        EngineConfig(host="0.0.0.0")
    assert "--auth-token-file" in str(e.value) and "127.0.0.1" in str(e.value)
    EngineConfig(host="0.0.0.0", auth_token=TOKEN)  # with the token it is fine


def test_engine_cli_refuses_off_loopback_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != AUTH_TOKEN_ENV}
    res = subprocess.run(
        [sys.executable, "-m", "slime_async.engine", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 2 and AUTH_TOKEN_ENV in res.stderr, res.stderr


def test_engine_process_gets_the_token_through_its_environment_not_argv(tmp_path: Path) -> None:
    proc = EngineProcess(EngineConfig(dtype="fp32", auth_token=TOKEN, num_threads=1))
    url = proc.start()
    try:
        cmdline = Path(f"/proc/{proc.proc.pid}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline
        import asyncio

        assert asyncio.run(_status(url, "GET", "/health", None)) == 401
        assert asyncio.run(_status(url, "POST", "/generate", TOKEN, GEN)) == 200
    finally:
        proc.stop()


def test_engine_cli_reads_the_token_file(tmp_path: Path) -> None:
    from slime_async.engine.__main__ import add_engine_args
    from slime_async.engine.config import engine_config_from_args

    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    import argparse

    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--host", "0.0.0.0", "--auth-token-file", str(f)]
    )
    assert engine_config_from_args(args).auth_token == TOKEN
    (tmp_path / "empty").write_text("\n")
    args.auth_token_file = str(tmp_path / "empty")
    with pytest.raises(ValueError, match="empty"):
        engine_config_from_args(args)


def _router_args(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    add_router_args(p, prefix="")
    return p.parse_args(list(argv))


def test_router_takes_its_token_from_the_env_var_or_the_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)
    assert router_config_from_args(_router_args("--host", "0.0.0.0"), prefix="").auth_token == TOKEN
    f = tmp_path / "t"
    f.write_text("from-file")
    cfg = router_config_from_args(_router_args("--auth-token-file", str(f)), prefix="")
    assert cfg.auth_token == "from-file" and "from-file" not in repr(cfg)
    monkeypatch.delenv(AUTH_TOKEN_ENV)
    with pytest.raises(ValueError, match=AUTH_TOKEN_ENV):
        router_config_from_args(_router_args("--host", "0.0.0.0"), prefix="")


def test_router_cli_warns_that_auth_token_is_visible_in_ps() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "router", "--auth-token", "t", "--failure-threshold", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2  # a bad setting stops it before it serves
    assert "visible" in res.stderr and AUTH_TOKEN_ENV in res.stderr


async def test_router_presents_the_shared_token_to_its_engines(engine) -> None:
    router = Router(RouterConfig(worker_urls=(engine,), auth_token=TOKEN))
    url = await router.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json=GEN) as r:
                assert r.status == 200, await r.text()
                assert len((await r.json())["output_ids"]) == 2
            async with s.post(url + "/flush_cache", headers=_auth(TOKEN)) as r:
                assert r.status == 200, await r.text()
            async with s.post(url + "/flush_cache") as r:
                assert r.status == 401
    finally:
        await router.stop()


async def test_attaching_a_token_protected_engine_uses_the_run_token(engine) -> None:
    from slime_async.contracts.engine import EngineLaunch
    from slime_async.engine.backends import EngineFleetConfig
    from slime_async.engine.backends.external import EngineAttachError, ExternalBackend

    fleet = EngineFleetConfig(backend="external", urls=(engine,), attach_timeout_s=2)
    with_token = ExternalBackend(fleet, EngineConfig(auth_token=TOKEN))
    await with_token.preflight()
    h = await with_token.start(EngineLaunch(index=0, model_dir="", weight_version=0, seed=0))
    assert await with_token.alive(h)
    without = ExternalBackend(fleet, EngineConfig())
    with pytest.raises(EngineAttachError, match="401"):
        await without.preflight()


async def test_router_off_loopback_needs_the_token_on_every_route_but_the_probes(engine) -> None:
    """Bound beyond loopback (here the wildcard address; the test talks to it on 127.0.0.1),
    generation and info routes need the token too; only the health probes stay open."""
    router = Router(RouterConfig(worker_urls=(engine,), auth_token=TOKEN, host="0.0.0.0"))
    url = await router.start()
    base = "http://127.0.0.1:" + url.rsplit(":", 1)[1]
    try:
        assert await _status(base, "POST", "/generate", None, GEN) == 401
        assert await _status(base, "GET", "/model_info", None) == 401
        assert await _status(base, "GET", "/metrics", "wrong") == 401
        assert await _status(base, "POST", "/generate", TOKEN, GEN) == 200
        for probe in ("/health", "/liveness", "/readiness"):
            assert await _status(base, "GET", probe, None) in (200, 503)
    finally:
        await router.stop()
