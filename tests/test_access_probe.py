"""Every route of the three HTTP servers of a run (the real embedded engine, the real router in
front of it, the training gateway), sent with no key, the data-plane key, the admin key and a
wrong key, against the one access table (`router.access.ACCESS`, `expected`): a route is in the
table exactly when a server registers it, and each credential gets what the table says. The
table docs/security.md shows is generated from the same data (`scripts/gen_access_doc.py`)."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from router.access import ACCESS, CREDENTIALS, expected
from router.config import RouterConfig
from router.server import Router
from router.server import build_app as router_app
from slime_async.contracts.chat import IdText
from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.server import build_app as engine_app
from slime_async.rollout.agents.gateway import TrainingGateway

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[1]
DATA = "probe-data-" + "d" * 21
ADMIN = "probe-admin-" + "a" * 20
KEYS = {"none": None, "data": DATA, "admin": ADMIN, "wrong": "probe-wrong-" + "w" * 20}
_JUNK = b"{"
"""Every POST carries a body no handler accepts: a request that passes the check is answered
by the route itself (400, 404, ...) and changes nothing."""


def _routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, route pattern) of every route `app` registers (HEAD: aiohttp's twin of GET)."""
    out = []
    for resource in app.router.resources():
        for route in resource:
            if route.method != "HEAD":
                out.append((route.method, resource.canonical))
    return out


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineServer]:
    torch.set_num_threads(1)
    cfg = EngineConfig(dtype="fp32", api_key=DATA, admin_api_key=ADMIN, weight_version="0")
    srv = EngineServer(cfg)
    srv.start()
    yield srv
    srv.stop()


@contextlib.asynccontextmanager
async def _servers(
    srv: EngineServer,
) -> AsyncIterator[dict[str, tuple[str, list[tuple[str, str]]]]]:
    """The three servers with both keys: {server: (url, its registered routes)}."""
    engine_url = srv.url
    router = Router(RouterConfig(worker_urls=(engine_url,), api_key=DATA, admin_api_key=ADMIN))
    router_url = await router.start()
    gateway = TrainingGateway(tokenizer=IdText(), eos_id=None, api_key=DATA)
    gateway_url = await gateway.start()
    assert gateway._runner is not None
    apps = {
        "engine": (engine_url, _routes(engine_app(srv.engine))),
        "router": (router_url, _routes(router_app(router))),
        "gateway": (gateway_url, _routes(gateway._runner.app)),
    }
    try:
        yield apps
    finally:
        await gateway.stop()
        await router.stop()


async def test_every_route_with_every_credential_against_the_table(engine) -> None:
    async with _servers(engine) as servers:
        for server, (_url, routes) in servers.items():
            served = {pattern for _m, pattern in routes}
            rows = {path for (s, path) in ACCESS if s == server}
            assert served - rows == set(), f"{server} routes missing from router.access.ACCESS"
            assert rows - served == set(), f"{server} rows in ACCESS that it does not serve"
        wrong = await _probe(servers)
    assert not wrong, "\n".join(wrong)


async def _probe(servers: dict[str, tuple[str, list[tuple[str, str]]]]) -> list[str]:
    """Send every route with every credential; the outcomes that differ from the table."""
    wrong: list[str] = []
    async with aiohttp.ClientSession() as s:
        for server, (url, routes) in servers.items():
            for method, pattern in routes:
                path = pattern.replace("{worker_id}", "nope").replace("{eid}", "nope")
                verb = "POST" if method == "*" else method
                priv = ACCESS[(server, pattern)]
                for cred in CREDENTIALS:
                    key = KEYS[cred]
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    body = _JUNK if verb in ("POST", "PUT") else None
                    async with s.request(verb, url + path, data=body, headers=headers) as r:
                        await r.read()
                        got = r.status
                    want = expected(priv, cred)
                    ok = got == 401 if want == "401" else got not in (401, 403) and got < 500
                    if not ok:
                        wrong.append(f"{server} {verb} {path} with {cred}: {got}, want {want}")
    return wrong


async def test_a_leaked_agent_credential_cannot_change_weights(engine, monkeypatch, tmp_path):
    """The run's own wiring (flags -> keys -> generate chain -> agent link): the key an agent's
    client holds opens generation, and no control route of the router or the engine."""
    import dataclasses

    from router.access import ADMIN_KEY_ENV, API_KEY_ENV
    from slime_async.config import parse_config
    from slime_async.contracts.rollout import GenerationRequest, Prompt
    from slime_async.orchestrator.generate_chain import build_generate_chain
    from slime_async.rollout.agents.agent import AgentGenerate
    from slime_async.rollout.data.plan import make_data_plan
    from tests.plugins import leaky_agent

    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
    monkeypatch.setenv(API_KEY_ENV, DATA)  # the engine's; without it the run mints one
    cfg = parse_config(
        ["--run-dir", str(tmp_path), "--agent-function-path", "tests.plugins.leaky_agent:agent"]
    )
    assert (cfg.engine.api_key, cfg.engine.admin_api_key) == (DATA, ADMIN)
    router = Router(dataclasses.replace(cfg.router, worker_urls=(engine.url,)))
    url = await router.start()
    plan = make_data_plan(cfg.rollout, seed=cfg.rollout_seed, hf_checkpoint=None)
    chain = build_generate_chain(cfg, router_url=url, plan=plan)
    weights = {"model_path": str(tmp_path), "weight_version": "66"}
    leaky_agent.TARGETS[:] = [
        (url + "/update_weights_from_disk", weights),
        (url + "/update_weight_version", {"new_version": "66"}),
        (url + "/pause_generation", {"mode": "abort"}),
        (url + "/workers", {"url": "http://127.0.0.1:9"}),
        (engine.url + "/update_weights_from_disk", weights),
        (engine.url + "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}),
        (engine.url + "/pause_generation", {"mode": "abort"}),
    ]
    leaky_agent.SEEN.clear()
    try:
        assert isinstance(chain.sample, AgentGenerate)
        first = plan.source.next_prompt()
        assert first is not None
        prompt = Prompt(key="p", prompt_ids=tuple(first.prompt_ids), payload={})
        res = await chain.sample(
            GenerationRequest(prompt=prompt, group_seq=0, sample_index=0), 0, 8
        )
    finally:
        await chain.close()
        await router.stop()
    assert res.output_ids, res.payload  # the agent generated through the gateway
    keys = {k for k, _u, _s in leaky_agent.SEEN}
    assert keys == {DATA}  # the run's data-plane key, never the admin key
    refused = [(u, st) for _k, u, st in leaky_agent.SEEN if st != 401]
    assert len(leaky_agent.SEEN) == 7 and not refused, refused
    auth = {"Authorization": f"Bearer {DATA}"}
    async with aiohttp.ClientSession(headers=auth) as s, s.get(engine.url + "/model_info") as r:
        assert (await r.json())["weight_version"] != "66"


def test_the_stock_sglang_router_with_the_data_plane_key(engine) -> None:
    """What docs/security.md says of the PyPI router: its one key, asked of clients on
    /generate and /workers, presented to the workers; their admin routes refuse it."""
    import json
    import urllib.error
    import urllib.request

    from slime_async.engine.testing import stock_sglang_router

    def call(url: str, method: str, path: str, key: str | None, body=None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return int(r.status), r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    gen = {"input_ids": [3, 1, 4], "sampling_params": {"max_new_tokens": 2}}
    with stock_sglang_router([engine.url], api_key=DATA) as url:
        assert call(url, "POST", "/generate", None, gen)[0] == 401
        assert call(url, "POST", "/generate", DATA, gen)[0] == 200  # presented to the engine
        assert call(url, "GET", "/workers", None)[0] == 401
        assert call(url, "GET", "/v1/models", None)[0] == 200  # its own model list: open
        status, body = call(url, "GET", "/get_model_info", None)  # passed on without a key:
        assert status == 401 and b"data-plane key" in body  # the engine refuses it
        status, body = call(url, "POST", "/flush_cache", DATA)
        assert status == 206 and json.loads(body)["workers_flushed"] == 0, body


def test_security_md_shows_the_table() -> None:
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts/gen_access_doc.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = gen.DOC.read_text()
    assert gen.render(doc) == doc, "run: python scripts/gen_access_doc.py"
