"""SGLang's two keys on the real embedded engine and the real router: the data-plane key opens
generation and info only, the admin key the control routes only (constant-time compare); the
router asks for them on loopback too and presents each to the engines behind it; the keys never
travel on a command line; a request without its key is refused before its body is read. Every
route against the one access table: tests/test_access_probe.py."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from router.access import ADMIN_KEY_ENV, API_KEY_ENV
from router.config import RouterConfig, add_router_args, router_config_from_args
from router.server import Router
from slime_async.engine import EngineConfig, EngineProcess, EngineServer

pytestmark = pytest.mark.timeout(180)
DATA = "data-" + "d" * 27
ADMIN = "admin-" + "a" * 26
GEN = {"input_ids": [3, 1, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    srv = EngineServer(EngineConfig(dtype="fp32", api_key=DATA, admin_api_key=ADMIN))
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


DATA_ROUTES = [
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
    ("GET", "/v1/models", None),
    ("POST", "/generate", GEN),
]
ADMIN_ROUTES = [
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/flush_cache", None),
    ("POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
]


@pytest.mark.parametrize(("method", "path", "body"), DATA_ROUTES)
async def test_data_routes_take_the_data_key_only(engine, method, path, body) -> None:
    for token in (None, DATA[:-1] + "y", "", ADMIN):  # the admin key does not open them
        assert await _status(engine, method, path, token, body) == 401, token
    assert await _status(engine, method, path, DATA, body) == 200


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES)
async def test_admin_routes_take_the_admin_key_only(engine, method, path, body) -> None:
    for token in (None, ADMIN[:-1] + "y", "", DATA):  # the data key never changes weights
        assert await _status(engine, method, path, token, body) == 401, token
    assert await _status(engine, method, path, ADMIN, body) == 200


async def test_health_probes_are_open(engine) -> None:
    for path in ("/health", "/ready"):
        assert await _status(engine, "GET", path, None) == 200


def test_a_request_without_its_key_is_refused_before_its_body_is_read(engine) -> None:
    """64 MiB announced, 10 bytes sent: the answer is a 401 at once, not a wait for the rest
    (the limits middleware used to read the body first, up to --client-timeout-s)."""
    host, port = engine.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 67108864\r\n\r\n0123456789"
        )
        t0 = time.monotonic()
        s.settimeout(5)
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 401"), head[:200]
    assert time.monotonic() - t0 < 5


def test_key_settings_that_cannot_be_safe_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=API_KEY_ENV) as e:
        EngineConfig(host="0.0.0.0", admin_api_key=ADMIN)
    assert "--api-key-file" in str(e.value) and "127.0.0.1" in str(e.value)
    EngineConfig(host="0.0.0.0", api_key=DATA, admin_api_key=ADMIN)  # both: fine
    with pytest.raises(ValueError, match="use two keys"):
        EngineConfig(api_key=DATA, admin_api_key=DATA)
    with pytest.raises(ValueError, match="--open-data-plane"):  # generation open to the machine
        EngineConfig(admin_api_key=ADMIN)
    with pytest.raises(ValueError, match="whitespace"):
        EngineConfig(api_key=" padded")
    with pytest.raises(ValueError, match="off loopback"):
        EngineConfig(host="0.0.0.0", admin_api_key=ADMIN, open_data_plane=True)


def test_engine_cli_refuses_off_loopback_without_a_data_key() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, ADMIN_KEY_ENV)}
    res = subprocess.run(
        [sys.executable, "-m", "slime_async.engine", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 2 and API_KEY_ENV in res.stderr, res.stderr


def test_engine_process_gets_its_keys_through_its_environment_not_argv() -> None:
    cfg = EngineConfig(dtype="fp32", api_key=DATA, admin_api_key=ADMIN, num_threads=1)
    proc = EngineProcess(cfg)
    url = proc.start()
    try:
        cmdline = Path(f"/proc/{proc.proc.pid}/cmdline").read_bytes()
        assert DATA.encode() not in cmdline and ADMIN.encode() not in cmdline
        assert asyncio.run(_status(url, "POST", "/generate", None, GEN)) == 401
        assert asyncio.run(_status(url, "POST", "/generate", DATA, GEN)) == 200
        assert asyncio.run(_status(url, "POST", "/flush_cache", DATA)) == 401
        assert asyncio.run(_status(url, "POST", "/flush_cache", ADMIN)) == 200
    finally:
        proc.stop()


def test_engine_cli_reads_the_key_files(tmp_path: Path) -> None:
    import argparse

    from slime_async.engine.__main__ import add_engine_args
    from slime_async.engine.config import engine_config_from_args

    (tmp_path / "data").write_text(DATA + "\n")
    (tmp_path / "admin").write_text(ADMIN + "\n")
    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        [
            *("--host", "0.0.0.0", "--api-key-file", str(tmp_path / "data")),
            *("--auth-token-file", str(tmp_path / "admin")),
        ]
    )
    cfg = engine_config_from_args(args)
    assert (cfg.api_key, cfg.admin_api_key) == (DATA, ADMIN)
    (tmp_path / "empty").write_text("\n")
    args.auth_token_file = str(tmp_path / "empty")
    with pytest.raises(ValueError, match="empty"):
        engine_config_from_args(args)


def _router_args(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    add_router_args(p, prefix="")
    return p.parse_args(list(argv))


def test_router_takes_its_keys_from_the_env_vars_or_the_files(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
    monkeypatch.setenv(API_KEY_ENV, DATA)
    cfg = router_config_from_args(_router_args("--host", "0.0.0.0"), prefix="")
    assert (cfg.api_key, cfg.admin_api_key) == (DATA, ADMIN)
    (tmp_path / "d").write_text("from-file")
    cfg = router_config_from_args(_router_args("--api-key-file", str(tmp_path / "d")), prefix="")
    assert cfg.api_key == "from-file" and "from-file" not in repr(cfg)
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(ValueError, match=API_KEY_ENV):  # the admin key alone: data plane open
        router_config_from_args(_router_args(), prefix="")
    cfg = router_config_from_args(_router_args("--open-data-plane"), prefix="")
    assert cfg.open_data_plane and cfg.api_key is None


def test_router_cli_warns_that_auth_token_is_visible_in_ps() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "router", "--auth-token", "t", "--failure-threshold", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2  # a bad setting stops it before it serves
    assert "visible" in res.stderr and ADMIN_KEY_ENV in res.stderr


async def test_router_presents_each_key_to_its_engines(engine) -> None:
    router = Router(RouterConfig(worker_urls=(engine,), api_key=DATA, admin_api_key=ADMIN))
    url = await router.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json=GEN, headers=_auth(DATA)) as r:
                assert r.status == 200, await r.text()  # the engine took the router's data key
                assert len((await r.json())["output_ids"]) == 2
            async with s.post(url + "/flush_cache", headers=_auth(ADMIN)) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["succeeded"] == 1  # ... and its admin key
            async with s.post(url + "/flush_cache", headers=_auth(DATA)) as r:
                assert r.status == 401
    finally:
        await router.stop()


async def test_router_on_loopback_never_opens_a_protected_engine(engine) -> None:
    """The report: bound to loopback with a key, the router answered generation (with a LoRA
    path too), chat, the model list and model info without any header, adding its own key."""
    router = Router(RouterConfig(worker_urls=(engine,), api_key=DATA, admin_api_key=ADMIN))
    url = await router.start()
    chat = {"messages": [{"role": "user", "content": "3 1 4"}], "max_tokens": 2}
    try:
        for method, path, body in [
            ("POST", "/generate", GEN),
            ("POST", "/generate", {**GEN, "lora_path": "policy"}),
            ("POST", "/v1/chat/completions", chat),
            ("GET", "/v1/models", None),
            ("GET", "/model_info", None),
            ("GET", "/metrics", None),
        ]:
            for token in (None, "wrong", ADMIN):
                assert await _status(url, method, path, token, body) == 401, (path, token)
        assert await _status(url, "POST", "/generate", DATA, GEN) == 200
        for probe in ("/health", "/liveness", "/readiness"):
            assert await _status(url, "GET", probe, None) in (200, 503)
    finally:
        await router.stop()


async def test_an_opened_data_plane_is_said_at_start_up(engine, caplog) -> None:
    open_engine = EngineServer(
        EngineConfig(dtype="fp32", admin_api_key=ADMIN, open_data_plane=True)
    )
    eurl = open_engine.start()
    cfg = RouterConfig(worker_urls=(eurl,), admin_api_key=ADMIN, open_data_plane=True)
    router = Router(cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="router.server"):
            url = await router.start()
        assert "open to every user of this machine (--open-data-plane)" in caplog.text
        assert await _status(url, "POST", "/generate", None, GEN) == 200
        assert await _status(url, "POST", "/flush_cache", None) == 401
        assert await _status(url, "POST", "/flush_cache", ADMIN) == 200
    finally:
        await router.stop()
        open_engine.stop()


async def test_attaching_a_protected_engine_uses_the_run_data_key(engine) -> None:
    from slime_async.config.engine_fleet import EngineFleetConfig
    from slime_async.contracts.engine import EngineLaunch
    from slime_async.orchestrator.engines.external import EngineAttachError, ExternalBackend

    fleet = EngineFleetConfig(backend="external", urls=(engine,), attach_timeout_s=2)
    keys = EngineConfig(api_key=DATA, admin_api_key=ADMIN)
    attached = ExternalBackend(fleet, keys)
    await attached.preflight()
    h = await attached.start(EngineLaunch(index=0, model_dir="", weight_version=0, seed=0))
    assert await attached.alive(h)
    without = ExternalBackend(fleet, EngineConfig())
    with pytest.raises(EngineAttachError, match="401"):
        await without.preflight()
