"""Unit tests of the router's pure parts: policies, registry transitions, config validation."""

from __future__ import annotations

import argparse

import pytest

from router.config import RouterConfig, add_router_args, router_config_from_args, validate_config
from router.metrics import metrics_prometheus
from router.policies import LeastExpectedTokens, LeastRequests, RoundRobin, make_policy
from router.proxy import parse_expected_tokens
from router.workers import WorkerRegistry, WorkerState


def _healthy_registry(n: int) -> tuple[WorkerRegistry, list]:
    reg = WorkerRegistry(failure_threshold=2, success_threshold=1)
    ws = [reg.add(f"http://127.0.0.1:{30000 + i}") for i in range(n)]
    for w in ws:
        reg.record_success(w)
    return reg, ws


def _assign(policy, workers, lengths: list[int]) -> list[int]:
    """Dispatch `lengths` in order (none finishes), returning per-worker token totals."""
    for L in lengths:
        w = policy.select(workers, expected_tokens=L)
        w.outstanding_requests += 1
        w.outstanding_tokens += L
    return [w.outstanding_tokens for w in workers]


def test_least_expected_tokens_routes_around_a_long_request() -> None:
    _, ws = _healthy_registry(2)
    pol = LeastExpectedTokens()
    first = pol.select(ws, expected_tokens=8000)
    first.outstanding_requests += 1
    first.outstanding_tokens += 8000
    picks = []
    for _ in range(10):
        w = pol.select(ws, expected_tokens=500)
        w.outstanding_requests += 1
        w.outstanding_tokens += 500
        picks.append(w)
    assert all(p is not first for p in picks)  # 10 x 500 = 5000 < 8000


def test_least_requests_and_round_robin_ignore_work() -> None:
    for pol in (LeastRequests(), RoundRobin()):
        _, ws = _healthy_registry(2)
        loads = _assign(pol, ws, [8000] + [500] * 10)
        assert min(loads) < 8000 < max(loads), type(pol).__name__  # long engine got small ones


@pytest.mark.parametrize("seed", range(5))
def test_least_expected_tokens_bound_on_heavy_tailed_lengths(seed: int) -> None:
    import random

    rng = random.Random(seed)
    lengths = [int(min(30000, 200 * rng.paretovariate(1.2))) for _ in range(60)]
    _, ws = _healthy_registry(4)
    loads = _assign(LeastExpectedTokens(), ws, lengths)
    # Greedy list scheduling: the most loaded engine exceeds the least by at most one request.
    assert max(loads) - min(loads) <= max(lengths)
    assert sum(loads) == sum(lengths)
    _, ws_rr = _healthy_registry(4)
    rr = _assign(RoundRobin(), ws_rr, lengths)
    assert max(loads) <= max(rr)


def test_ties_rotate_over_idle_engines() -> None:
    _, ws = _healthy_registry(3)
    pol = LeastExpectedTokens()
    picks = [pol.select(ws, expected_tokens=10) for _ in range(6)]  # nothing outstanding
    assert {id(p) for p in picks} == {id(w) for w in ws}


def test_make_policy_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="least_expected_tokens"):
        make_policy("fastest")


def test_registry_quarantine_and_readmission() -> None:
    reg = WorkerRegistry(failure_threshold=2, success_threshold=2)
    w = reg.add("http://127.0.0.1:30001")
    assert reg.add("http://127.0.0.1:30001") is w  # idempotent by url
    assert w.state is WorkerState.PENDING and not reg.healthy()
    reg.record_success(w)
    assert w.state is WorkerState.PENDING  # needs 2 successes
    reg.record_success(w)
    assert w.state is WorkerState.HEALTHY
    assert not reg.record_failure(w, "boom")
    assert reg.record_failure(w, "boom")
    assert w.state is WorkerState.QUARANTINED and w.quarantines == 1
    reg.record_success(w)
    reg.record_success(w)
    assert w.state is WorkerState.HEALTHY
    removed = reg.remove(w.id)
    assert removed is w and w.state is WorkerState.REMOVED and reg.all() == []


def test_expected_tokens_header_parsing() -> None:
    assert parse_expected_tokens(None, 77) == 77
    assert parse_expected_tokens(" 12 ", 77) == 12
    with pytest.raises(ValueError, match="X-Expected-Tokens"):
        parse_expected_tokens("lots", 77)
    with pytest.raises(ValueError, match=">= 0"):
        parse_expected_tokens("-3", 77)


def test_config_refuses_off_loopback_without_token() -> None:
    with pytest.raises(ValueError, match="without a data-plane key"):
        validate_config(RouterConfig(host="0.0.0.0"))
    validate_config(RouterConfig(host="0.0.0.0", api_key="t0k"))
    validate_config(RouterConfig(host="::1"))
    with pytest.raises(ValueError, match="http://"):
        validate_config(RouterConfig(worker_urls=("127.0.0.1:3000",)))
    with pytest.raises(ValueError, match="policy"):
        validate_config(RouterConfig(policy="random"))


def test_argparse_round_trip() -> None:
    ap = argparse.ArgumentParser()
    add_router_args(ap)
    args = ap.parse_args(
        [
            "--router-policy",
            "round_robin",
            "--router-worker-urls",
            "http://127.0.0.1:1",
            "--router-max-retries",
            "5",
        ]
    )
    cfg = router_config_from_args(args)
    assert cfg.policy == "round_robin" and cfg.worker_urls == ("http://127.0.0.1:1",)
    assert cfg.max_retries == 5


def test_prometheus_text_has_per_engine_series() -> None:
    reg, ws = _healthy_registry(2)
    ws[0].outstanding_tokens = 1234
    text = metrics_prometheus(router={"retries": 3, "policy": "x"}, workers=reg.all())
    assert "slime_router_retries 3" in text
    assert (
        f'slime_router_worker_outstanding_tokens{{worker_id="{ws[0].id}",url="{ws[0].url}"}} 1234'
        in text
    )
