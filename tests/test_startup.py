"""Start-up says what it is doing: one `start-up:` line per phase with the seconds since it began,
and a `waiting for ...` line every few seconds while an engine loads (the SGLang backend's wait on
`/health`, driven here by a local server that answers 503 before 200; no Ray, no SGLang)."""

from __future__ import annotations

import asyncio
import http.server
import logging
import threading
import time

import pytest

from slime_async import startup
from slime_async.config.engine_fleet import EngineFleetConfig
from slime_async.contracts.engine import EngineLaunch
from slime_async.engine.config import EngineConfig
from slime_async.engine.runner import wait_healthy
from slime_async.orchestrator.engines.sglang import SGLangBackend


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]


def test_phase_lines_carry_the_seconds_since_start_up_began(caplog) -> None:
    caplog.set_level(logging.INFO)
    startup.say("Ray (local node)")
    startup.say("building the trainer")
    startup.done("training from step 0")
    startup.say("Ray (local node)")  # a second start-up in the process starts its own clock
    startup.abandon()
    assert _lines(caplog) == [
        "start-up: Ray (local node) [0 s]",
        "start-up: building the trainer [0 s]",
        "start-up: done in 0 s; training from step 0",
        "start-up: Ray (local node) [0 s]",
    ]


async def test_waiting_says_so_every_few_seconds_and_returns_the_result(
    caplog, monkeypatch
) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(startup, "WAIT_EVERY_S", 0.05)

    async def slow() -> str:
        await asyncio.sleep(0.3)
        return "up"

    assert await startup.waiting(slow(), "engine 0", limit_s=900) == "up"
    lines = _lines(caplog)
    assert len(lines) >= 3, lines
    assert all(x.startswith("start-up: waiting for engine 0 (") for x in lines)
    assert lines[0].endswith(" s of 900 s)")
    caplog.clear()
    assert await startup.waiting(asyncio.sleep(0, "fast"), "engine 1") == "fast"
    assert _lines(caplog) == []  # nothing to say when nothing was waited for


class _Health(http.server.BaseHTTPRequestHandler):
    ready_at = 0.0

    def do_GET(self) -> None:
        code = 200 if time.monotonic() >= self.ready_at else 503
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self):
        return asyncio.to_thread(self.fn)


class _FakeSGLangActor:
    """The SGLang actor's surface, serving the real `/health` wait against `url`."""

    def __init__(self, url: str) -> None:
        self.start = _Method(lambda: (wait_healthy(url, timeout=30), url)[1])
        self.pid = _Method(lambda: 4242)
        self.log_path = _Method(lambda: "/tmp/slime_async_sglang/engine0_1234.log")


async def test_sglang_health_wait_is_reported_with_its_log_and_timeout(caplog, monkeypatch) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(startup, "WAIT_EVERY_S", 0.1)
    _Health.ready_at = time.monotonic() + 0.5  # 503 for half a second, then 200
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    backend = SGLangBackend(
        EngineFleetConfig(backend="sglang", start_timeout_s=900.0), EngineConfig()
    )
    monkeypatch.setattr(backend, "make_actor", lambda launch: _FakeSGLangActor(url))
    try:
        handle = await backend.start(
            EngineLaunch(index=0, model_dir="/m", weight_version=0, seed=0)
        )
    finally:
        server.shutdown()
    assert handle.url == url and handle.pid == 4242
    lines = _lines(caplog)
    assert len(lines) >= 3, lines
    want = "start-up: waiting for sglang server 0 /health, log /tmp/slime_async_sglang/engine0_1234"
    assert all(x.startswith(want) and x.endswith(" s of 900 s)") for x in lines), lines


@pytest.fixture(autouse=True)
def _fresh_clock():
    startup.abandon()
    yield
    startup.abandon()
