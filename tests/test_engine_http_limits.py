"""The embedded engine's HTTP limits against misbehaving clients (issue 17, Low): per-route body
limits, a deadline on sending a request, and a connection cap. Real engine servers, raw sockets
for the clients that misbehave below HTTP."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import aiohttp
import pytest

from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.testing import post

pytestmark = pytest.mark.timeout(180)
SAFETY_S = 60.0
"""Socket timeout that only turns a hang into a failure; no assertion depends on it."""


@pytest.fixture(scope="module")
def strict():
    srv = EngineServer(EngineConfig(dtype="fp32", max_request_mb=0.5, client_timeout_s=1.0))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def capped():
    srv = EngineServer(EngineConfig(dtype="fp32", max_connections=4, client_timeout_s=120.0))
    srv.start()
    yield srv
    srv.stop()


def _connect(url: str) -> socket.socket:
    u = urlsplit(url)
    s = socket.create_connection((u.hostname, u.port), timeout=SAFETY_S)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


async def test_bodies_over_the_route_limit_are_413(strict) -> None:
    big_control = b'{"mode": "abort", "pad": "' + b"x" * (2 << 20) + b'"}'
    big_generate = b'{"input_ids": [1], "pad": "' + b"x" * (1 << 20) + b'"}'
    async with aiohttp.ClientSession() as s:
        st, body = await post(s, strict.url + "/pause_generation", raw=big_control)
        assert st == 413 and "larger than" in body["error"]["message"]
        st, body = await post(s, strict.url + "/generate", raw=big_generate)
        assert st == 413 and "--max-request-mb" in body["error"]["message"]
        st, _ = await post(s, strict.url + "/generate", {"input_ids": [1, 2]})
        assert st == 200  # a normal request is unaffected


def test_a_client_that_never_finishes_its_headers_is_disconnected(strict) -> None:
    s = _connect(strict.url)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
    assert _read_all(s) == b""  # the server closed the connection (EOF, not the safety timeout)
    s.close()


def test_a_client_that_never_finishes_its_body_gets_408(strict) -> None:
    s = _connect(strict.url)
    s.sendall(b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"input_ids"')
    reply = _read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"not received within 1s" in reply


async def test_connections_beyond_the_cap_get_503_and_the_rest_are_served(capped) -> None:
    held = [_connect(capped.url) for _ in range(4)]
    for h in held:  # each is accepted: a request on it would be served
        h.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert h.recv(64).startswith(b"HTTP/1.1 200")
    extra = _connect(capped.url)
    reply = _read_all(extra)
    extra.close()
    assert reply.startswith(b"HTTP/1.1 503") and b"too many connections" in reply
    for h in held:
        h.close()
    async with aiohttp.ClientSession() as s:
        for _ in range(100):  # the closed ones are released as the server sees them go
            async with s.get(capped.url + "/health") as r:
                if r.status == 200:
                    break
        assert r.status == 200
