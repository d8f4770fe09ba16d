"""Property tests: the staleness budget is never exceeded and staleness stays within its bound.

Hypothesis draws (S, W, B, n, concurrency, lengths, probe on/off, weight-push lag, pauses);
each example runs the real worker against the simulated engine on the virtual-time loop. The
budget is checked from outside, through the public API: a wrapping PromptSource inspects the
worker's accounting and served version every time the worker pulls a prompt.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_worker import (
    DataWorkerConfig,
    InMemoryPromptSource,
    RolloutDataWorker,
    worst_case_staleness,
)
from data_worker.testing import SimulatedEngine
from data_worker.virtual_loop import run_virtual

pytestmark = pytest.mark.timeout(120)


class BudgetCheckingSource:
    """Delegates to a source; records every pull made while the budget was already full."""

    def __init__(self, inner: InMemoryPromptSource, *, S: int, B: int) -> None:
        self.inner, self.S, self.B = inner, S, B
        self.worker: RolloutDataWorker | None = None
        self.pulls = 0
        self.violations: list[tuple[int, int]] = []

    def next_prompt(self):
        acc = self.worker.accounting()  # type: ignore[union-attr]
        live = acc.dispatched - acc.dropped - acc.filtered
        limit = (self.S + self.worker.served_version + 1) * self.B  # type: ignore[union-attr]
        if live >= limit:
            self.violations.append((live, limit))
        self.pulls += 1
        return self.inner.next_prompt()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    S=st.integers(0, 3),
    W=st.one_of(st.integers(1, 9), st.just(math.inf)),
    B=st.integers(1, 4),
    n=st.integers(1, 3),
    inflight=st.integers(1, 12),
    lengths=st.lists(st.integers(1, 80), min_size=4, max_size=30),
    probe=st.booleans(),
    lag=st.integers(0, 3),
    pause_every=st.integers(0, 3),
    train_time=st.sampled_from([0.0, 0.005, 0.05]),
    steps=st.integers(2, 8),
)
def test_budget_never_exceeded_and_staleness_bounded(
    S, W, B, n, inflight, lengths, probe, lag, pause_every, train_time, steps
) -> None:
    lag = min(lag, S)  # engines may lag the trainer by at most S versions (else: deadlock error)
    cfg = DataWorkerConfig(
        n_samples_per_prompt=n,
        groups_per_step=B,
        max_staleness=S,
        fifo_window=W,
        max_inflight=inflight,
        length_probe=probe,
    )
    inner = InMemoryPromptSource(
        [{"prompt_ids": [i], "key": f"p{i}"} for i in range(len(lengths))], num_epochs=None
    )
    source = BudgetCheckingSource(inner, S=S, B=B)
    eng = SimulatedEngine(
        length_fn=lambda p, i: lengths[int(p.key[1:])] + 7 * i, token_time=1e-3, chunk=8
    )
    worker = RolloutDataWorker(cfg, source, eng.generate, abort_fn=eng.abort_all)
    source.worker = worker
    bound = worst_case_staleness(max_staleness=S, fifo_window=W, groups_per_step=B)
    consumed: list[tuple[str, int]] = []
    staleness: list[int] = []

    async def main() -> None:
        await worker.start()
        for k in range(steps):
            batch = await worker.get_batch(B, k, timeout=1e4)
            assert len(batch.groups) == B and batch.dropped == 0
            consumed.extend((g.prompt.key, g.prompt.epoch) for g in batch.groups)
            staleness.extend(batch.staleness())
            if pause_every and k % pause_every == 0:
                await worker.pause()
            await asyncio.sleep(train_time)
            eng.set_version(k + 1)
            worker.set_served_version(max(worker.served_version, k + 1 - lag))
            await worker.resume()
            assert worker.accounting().balanced
        await worker.stop()

    run_virtual(main())
    assert source.violations == [], f"admitted past the budget: {source.violations[:3]}"
    assert source.pulls > 0
    assert len(set(consumed)) == len(consumed) == steps * B
    assert max(staleness) <= bound
    if W == 1:
        assert max(staleness) <= S
    acc = worker.accounting()
    assert acc.balanced and acc.consumed == steps * B


def test_bound_is_reached_by_an_adversarial_schedule() -> None:
    """The window slack in the bound is real: W = B + 1 lets staleness reach S + 1."""
    S, B, W = 1, 2, 3
    # admitted at v = 0: groups 0..3; 0 and 3 are slow. k=0 takes [1, 2]; k=1 waits for 0 and
    # then takes 4 (window [3, 6)); k=2 takes 5 and waits for 3, generated at j=0: 2 = S + 1.
    lengths = {0: 400, 3: 800} | {i: 5 for i in (1, 2, 4, 5, 6, 7, 8, 9, 10, 11)}
    cfg = DataWorkerConfig(
        n_samples_per_prompt=1,
        groups_per_step=B,
        max_staleness=S,
        fifo_window=W,
        max_inflight=16,
        length_probe=False,
    )
    src = InMemoryPromptSource(
        [{"prompt_ids": [i], "key": f"p{i}"} for i in range(8)], num_epochs=None
    )
    eng = SimulatedEngine(length_fn=lambda p, i: lengths[int(p.key[1:])], chunk=5)
    worker = RolloutDataWorker(cfg, src, eng.generate)
    worst: list[int] = []

    async def main() -> None:
        await worker.start()
        for k in range(4):
            batch = await worker.get_batch(B, k)
            worst.append(max(batch.staleness()))
            eng.set_version(k + 1)
            worker.set_served_version(k + 1)
        await worker.stop()

    run_virtual(main())
    assert (
        max(worst)
        == S + 1
        == worst_case_staleness(max_staleness=S, fifo_window=W, groups_per_step=B)
    )
