"""Worker registry: the engines behind the router, their lifecycle state and live load counters.

Owns: `WorkerState`, `Worker`, `WorkerRegistry` (add/remove/lookup, failure/success accounting
that drives quarantine and re-admission, the wake-up event for requests waiting for an engine,
the `on_healthy` hook the late-binding dispatcher listens on).
Must never import: `slime_async`, aiohttp, or the proxy/health/server modules (pure bookkeeping).
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field


class WorkerState(enum.Enum):
    """Lifecycle of one engine as the router sees it.

    PENDING -> HEALTHY            first successful probe (after weight catch-up, if needed)
    HEALTHY -> QUARANTINED        `failure_threshold` consecutive failures (probes or requests)
    QUARANTINED -> HEALTHY        `success_threshold` consecutive successful probes (+ catch-up)
    HEALTHY -> SLEEPING           `/release_memory_occupation` through the router (router/sleep.py):
                                  no new request, the in-flight ones aborted and re-dispatched
    SLEEPING -> HEALTHY           `/resume_memory_occupation` (+ catch-up of missed weights)
    any -> REMOVED                `DELETE /workers/{id}`; in-flight requests still finish
    """

    PENDING = "pending"
    HEALTHY = "healthy"
    QUARANTINED = "quarantined"
    SLEEPING = "sleeping"
    REMOVED = "removed"


@dataclass(slots=True, eq=False)
class Worker:
    """One engine and its counters. Mutated only from the router's event loop."""

    url: str
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    state: WorkerState = WorkerState.PENDING
    outstanding_requests: int = 0
    """Requests forwarded and not yet finished."""
    outstanding_tokens: int = 0
    """Sum of the expected response tokens of those requests (the balancing signal)."""
    consecutive_failures: int = 0
    """Consecutive failed health probes."""
    consecutive_successes: int = 0
    """Consecutive successful health probes."""
    request_failures: int = 0
    """Consecutive failed proxied requests (an engine whose /health is fine but whose
    /generate fails is a zombie: probes alone would never take it out of rotation)."""
    total_requests: int = 0
    total_failures: int = 0
    retries_away: int = 0
    """Requests that failed here and were retried on another engine."""
    quarantines: int = 0
    last_error: str = ""
    state_since: float = field(default_factory=time.monotonic)
    weight_generation: int = 0
    """Index of the last weight-changing control call this engine applied (see health catch-up)."""
    preemptions: int = 0
    """Times the engine was put to sleep; a request that sees this change while it runs was cut
    by a preemption (the proxy re-dispatches it)."""
    sleep_tags: tuple[str, ...] = ()
    """The memory tags released on the engine while SLEEPING."""

    @property
    def is_healthy(self) -> bool:
        """True when the policy may route new requests here."""
        return self.state is WorkerState.HEALTHY

    def to_json(self) -> dict:
        """The `GET /workers` entry (sglang-router's shape plus our load fields)."""
        return {
            "id": self.id,
            "url": self.url,
            "model_id": "default",
            "priority": 50,
            "cost": 1.0,
            "worker_type": "regular",
            "is_healthy": self.is_healthy,
            "load": self.outstanding_requests,
            "connection_mode": "http",
            "state": self.state.value,
            "outstanding_requests": self.outstanding_requests,
            "outstanding_tokens": self.outstanding_tokens,
            "total_requests": self.total_requests,
            "total_failures": self.total_failures,
            "retries_away": self.retries_away,
            "quarantines": self.quarantines,
            "preemptions": self.preemptions,
            "sleep_tags": list(self.sleep_tags),
            "last_error": self.last_error,
        }


class WorkerRegistry:
    """Engines by id, with the state transitions the health checker and proxy drive.

    Example:
        >>> reg = WorkerRegistry(failure_threshold=2, success_threshold=1)
        >>> w = reg.add("http://127.0.0.1:30001")
        >>> reg.record_success(w); w.state.value
        'healthy'
        >>> reg.record_failure(w, "refused"); reg.record_failure(w, "refused"); w.state.value
        'quarantined'
    """

    def __init__(self, *, failure_threshold: int, success_threshold: int) -> None:
        self._workers: dict[str, Worker] = {}
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self._healthy_event = asyncio.Event()
        self.weight_generation = 0
        """Count of weight-changing control calls the router has fanned out successfully."""
        self.on_healthy: list[Callable[[], None]] = []
        """Called (synchronously) whenever a worker becomes HEALTHY: the dispatcher binds
        queued requests to it."""

    # --- membership -------------------------------------------------------------------------
    def add(self, url: str) -> Worker:
        """Register `url` (idempotent: an already-registered url returns its worker)."""
        for w in self._workers.values():
            if w.url == url:
                return w
        w = Worker(url=url)
        self._workers[w.id] = w
        return w

    def remove(self, worker_id: str) -> Worker | None:
        """Unregister; the worker object lives on until its in-flight requests finish."""
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._set_state(w, WorkerState.REMOVED)
        return w

    def get(self, worker_id: str) -> Worker | None:
        """The worker with this id, or None."""
        return self._workers.get(worker_id)

    def find_url(self, url: str) -> Worker | None:
        """The worker registered under `url`, or None."""
        return next((w for w in self._workers.values() if w.url == url), None)

    def all(self) -> list[Worker]:
        """Every registered worker, in registration order."""
        return list(self._workers.values())

    def healthy(self) -> list[Worker]:
        """Workers the policy may choose from."""
        return [w for w in self._workers.values() if w.state is WorkerState.HEALTHY]

    # --- health accounting ------------------------------------------------------------------
    def record_failure(self, w: Worker, error: str) -> bool:
        """Count a failed health probe; return True if this call quarantined the worker."""
        w.consecutive_failures += 1
        w.consecutive_successes = 0
        return self._failed(w, w.consecutive_failures, error)

    def record_request_failure(self, w: Worker, error: str) -> bool:
        """Count a failed proxied request; return True if this call quarantined the worker."""
        w.request_failures += 1
        return self._failed(w, w.request_failures, error)

    def record_request_success(self, w: Worker) -> None:
        """A proxied request succeeded: the engine serves, reset its request-failure streak."""
        w.request_failures = 0

    def _failed(self, w: Worker, streak: int, error: str) -> bool:
        w.total_failures += 1
        w.last_error = error
        if w.state in (WorkerState.REMOVED, WorkerState.QUARANTINED, WorkerState.SLEEPING):
            return False
        if streak >= self.failure_threshold:
            self.quarantine(w, error)
            return True
        return False

    def quarantine(self, w: Worker, reason: str) -> None:
        """Take `w` out of rotation now (the health checker re-admits it on recovery); a
        sleeping engine stays asleep (its wake decides)."""
        if w.state in (WorkerState.QUARANTINED, WorkerState.REMOVED, WorkerState.SLEEPING):
            return
        w.quarantines += 1
        w.last_error = reason
        w.consecutive_successes = 0
        self._set_state(w, WorkerState.QUARANTINED)

    def record_success(self, w: Worker, *, admit: bool = True) -> bool:
        """Count a success; return True if `w` should now be (re-)admitted.

        With `admit=True` the state flips to HEALTHY right away; the health checker passes
        `admit=False` when it must bring the engine's weights up to date first.
        """
        w.consecutive_failures = 0
        w.consecutive_successes += 1
        if w.state in (WorkerState.PENDING, WorkerState.QUARANTINED) and (
            w.consecutive_successes >= self.success_threshold
        ):
            if admit:
                self.admit(w)
            return True
        return False

    def sleep(self, w: Worker) -> None:
        """Take `w` out of rotation for a sleep (no probe re-admits it; only `admit` after its
        wake does); requests in flight on it now count as cut by this preemption."""
        if w.state is WorkerState.REMOVED:
            return
        w.preemptions += 1
        self._set_state(w, WorkerState.SLEEPING)

    def admit(self, w: Worker) -> None:
        """Put `w` into rotation and wake requests waiting for an engine."""
        if w.state is WorkerState.REMOVED:
            return
        w.request_failures = 0
        self._set_state(w, WorkerState.HEALTHY)

    def _set_state(self, w: Worker, state: WorkerState) -> None:
        if w.state is not state:
            w.state = state
            w.state_since = time.monotonic()
            if state is WorkerState.HEALTHY:
                for callback in self.on_healthy:
                    callback()
        if self.healthy():
            self._healthy_event.set()
        else:
            self._healthy_event.clear()

    async def wait_for_healthy(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for any healthy worker; True if one exists."""
        if self.healthy():
            return True
        if timeout <= 0:
            return False
        try:
            await asyncio.wait_for(self._healthy_event.wait(), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return False
        return bool(self.healthy())
