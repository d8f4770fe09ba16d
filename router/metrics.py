"""Metrics rendering: the `/metrics` JSON document and its Prometheus text form.

Owns: `metrics_json`, `metrics_prometheus`. Pure functions over the counters other modules keep.
Must never import: `slime_async`, aiohttp.
"""

from __future__ import annotations

from router.workers import Worker

_WORKER_GAUGES = (
    ("outstanding_requests", "gauge", "Requests in flight on the engine."),
    ("outstanding_tokens", "gauge", "Expected response tokens in flight on the engine."),
    ("total_requests", "counter", "Requests forwarded to the engine."),
    ("total_failures", "counter", "Failed probes and requests on the engine."),
    ("retries_away", "counter", "Requests that failed on the engine and were retried elsewhere."),
    ("quarantines", "counter", "Times the engine was quarantined."),
)


def metrics_json(*, router: dict[str, float | int | str], workers: list[Worker]) -> dict:
    """`{"router": {...counters...}, "workers": [per-engine entries]}`."""
    return {"router": dict(router), "workers": [w.to_json() for w in workers]}


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metrics_prometheus(*, router: dict[str, float | int | str], workers: list[Worker]) -> str:
    """Prometheus exposition text (version 0.0.4) of the same numbers."""
    lines: list[str] = []
    for key, value in router.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        name = f"slime_router_{key}"
        lines += [f"# TYPE {name} gauge", f"{name} {value}"]
    for attr, kind, help_text in _WORKER_GAUGES:
        name = f"slime_router_worker_{attr}"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for w in workers:
            labels = f'worker_id="{_esc(w.id)}",url="{_esc(w.url)}"'
            lines.append(f"{name}{{{labels}}} {getattr(w, attr)}")
    name = "slime_router_worker_healthy"
    lines += [f"# TYPE {name} gauge"]
    for w in workers:
        labels = f'worker_id="{_esc(w.id)}",url="{_esc(w.url)}",state="{w.state.value}"'
        lines.append(f"{name}{{{labels}}} {int(w.is_healthy)}")
    return "\n".join(lines) + "\n"
