"""Behaviour of RolloutDataWorker with a simulated engine (asyncio sleeps proportional to length).

Most tests run on the virtual-time event loop (`run_virtual`): the real worker code, simulated
seconds, deterministic and fast. One test runs on the ordinary pytest-asyncio loop.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from data_worker import (
    PROBE_PRIORITY,
    DataWorkerConfig,
    FinishStatus,
    GenerationResult,
    InMemoryPromptSource,
    Prompt,
    RolloutDataWorker,
)
from data_worker.testing import SimulatedEngine
from data_worker.virtual_loop import run_virtual

pytestmark = pytest.mark.timeout(60)


def _source(n: int, *, epochs: int | None = 1) -> InMemoryPromptSource:
    return InMemoryPromptSource(
        [{"prompt_ids": [i], "key": f"p{i}"} for i in range(n)], num_epochs=epochs
    )


def _len_by_key(lengths: dict[str, int]):
    return lambda prompt, _i: lengths[prompt.key]


def _cfg(**kw) -> DataWorkerConfig:
    base = dict(n_samples_per_prompt=2, groups_per_step=2, max_staleness=4, fifo_window=math.inf)
    base.update(kw)
    return DataWorkerConfig(**base)


@pytest.mark.parametrize("siblings", ["hold", "queue"])
def test_probe_then_longest_first_then_cached_dispatch(siblings: str) -> None:
    lengths = {"p0": 10, "p1": 30}
    eng = SimulatedEngine(length_fn=_len_by_key(lengths))
    cfg = _cfg(
        n_samples_per_prompt=3,
        groups_per_step=1,
        max_inflight=1,
        max_queued_samples=100,  # both groups are admitted at once
        default_expected_len=77,
        priority_bucket_groups=100,
        probe_siblings=siblings,
        max_staleness=1,  # B = 1: two groups admitted at v = 0, i.e. epoch 0 only
    )
    worker = RolloutDataWorker(cfg, _source(2, epochs=2), eng.generate)

    async def main() -> None:
        await worker.start()
        for k in range(2):
            await worker.get_batch(1, k)
        worker.set_served_version(2)  # epoch 1 is admitted after both lengths are known
        for k in range(2, 4):
            await worker.get_batch(1, k)
        await worker.stop()

    run_virtual(main())
    calls = [(c.key, c.sample_index, c.priority, c.expected_len) for c in eng.calls]
    # epoch 0: both probes first (top priority, default length), then the longer prompt's rest
    assert calls[:6] == [
        ("p0", 0, PROBE_PRIORITY, 77),
        ("p1", 0, PROBE_PRIORITY, 77),
        ("p1", 1, 30.0, 30),
        ("p1", 2, 30.0, 30),
        ("p0", 1, 10.0, 10),
        ("p0", 2, 10.0, 10),
    ]
    # epoch 1: prompts are known -> all n at the cached priority, no probe
    assert sorted(calls[6:]) == sorted(
        [("p0", i, 10.0, 10) for i in range(3)] + [("p1", i, 30.0, 30) for i in range(3)]
    )
    assert worker.metrics()["data/probe_hit_rate"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("siblings", "active", "sib_len"), [("queue", 4, 5), ("backfill", 4, 5), ("hold", 3, 20)]
)
def test_probe_siblings_modes_use_idle_slots(siblings: str, active: int, sib_len: int) -> None:
    eng = SimulatedEngine(length_fn=lambda p, i: 20)
    cfg = _cfg(
        n_samples_per_prompt=4,
        groups_per_step=1,
        max_staleness=0,
        max_inflight=8,
        probe_siblings=siblings,
        default_expected_len=5,
    )
    worker = RolloutDataWorker(cfg, _source(1), eng.generate)

    async def main() -> None:
        await worker.start()
        batch = await worker.get_batch(1, 0)
        assert len(batch.groups[0].samples) == 4
        await worker.stop()

    run_virtual(main())
    # S = 0, B = 1: the budget admits one group; only "hold" leaves slots idle during the probe
    assert eng.max_active == active
    assert {c.expected_len for c in eng.calls if c.sample_index > 0} == {sib_len}


def test_no_probe_mode_dispatches_all_samples_in_submission_order() -> None:
    eng = SimulatedEngine(length_fn=lambda p, i: 10 + 10 * int(p.key[1:]))
    cfg = _cfg(length_probe=False, max_inflight=1, n_samples_per_prompt=2, groups_per_step=1)
    worker = RolloutDataWorker(cfg, _source(3), eng.generate)

    async def main() -> None:
        await worker.start()
        for _ in range(3):
            await worker.get_batch(1, 0)
        await worker.stop()

    run_virtual(main())
    assert [(c.group_seq, c.sample_index) for c in eng.calls] == [
        (s, i) for s in range(3) for i in range(2)
    ]
    assert {c.priority for c in eng.calls} == {0.0}


@pytest.mark.parametrize(
    ("window", "expected"), [(1, [0, 1, 2, 3, 4, 5]), (math.inf, [5, 4, 3, 2, 1, 0])]
)
def test_window_orders_consumption(window: float, expected: list[int]) -> None:
    # later prompts are shorter, so they complete first
    eng = SimulatedEngine(length_fn=lambda p, i: 60 - 10 * int(p.key[1:]), chunk=10)
    cfg = _cfg(fifo_window=window, groups_per_step=1, max_staleness=10, max_inflight=64)
    worker = RolloutDataWorker(cfg, _source(6), eng.generate)
    order: list[int] = []

    async def main() -> None:
        await worker.start()
        await asyncio.sleep(1.0)  # everything completes
        for _ in range(6):
            order.extend(g.seq for g in (await worker.get_batch(1, 0)).groups)
        await worker.stop()

    run_virtual(main())
    assert order == expected


def test_window_head_blocks_until_the_head_group_completes() -> None:
    # group 0 is slow; W = 2 lets group 1 through but holds 2.. until 0 is consumed
    eng = SimulatedEngine(
        length_fn=lambda p, i: 500 if p.key == "p0" else 10 * int(p.key[1:]), chunk=10
    )
    cfg = _cfg(fifo_window=2, groups_per_step=1, max_staleness=10, max_inflight=64)
    worker = RolloutDataWorker(cfg, _source(5), eng.generate)

    async def main() -> None:
        await worker.start()
        first = await worker.get_batch(1, 0)
        assert [g.seq for g in first.groups] == [1]
        await asyncio.sleep(0.1)  # 2, 3, 4 complete; 0 needs 0.5 s
        m = worker.metrics()
        assert m["data/blocked_groups"] == 3 and m["data/eligible_groups"] == 0
        with pytest.raises(TimeoutError):
            await worker.get_batch(1, 0, timeout=0.1)
        nxt = await worker.get_batch(3, 0)
        assert [g.seq for g in nxt.groups] == [0, 2, 3]  # head first, then 2 and 3 released
        assert asyncio.get_running_loop().time() == pytest.approx(0.5)  # group 0's length
        await worker.stop()

    run_virtual(main())


def test_off_policy_groups_are_dropped_and_counted() -> None:
    eng = SimulatedEngine(length_fn=lambda p, i: 10, chunk=10)
    cfg = _cfg(groups_per_step=2, max_staleness=2, max_off_policy_steps=1, max_inflight=64)
    worker = RolloutDataWorker(cfg, _source(50), eng.generate)

    async def main() -> None:
        await worker.start()
        b0 = await worker.get_batch(2, 0)
        assert b0.dropped == 0 and b0.staleness() == [0, 0]
        await asyncio.sleep(0.1)  # the rest of the budget (4 more groups at v = 0) completes
        eng.set_version(3)
        worker.set_served_version(3)
        b3 = await worker.get_batch(2, 3)
        assert b3.dropped == 4  # all j = 0 groups: 3 - 0 > 1
        assert all(s <= 1 for s in b3.staleness()) and len(b3.groups) == 2
        acc = worker.accounting()
        assert acc.dropped == 4 and acc.balanced
        m = worker.metrics()
        assert m["staleness/dropped"] == 4.0 and m["data/dropped_groups"] == 4.0
        assert m["staleness/hist"] == b3.staleness_hist() and sum(m["staleness/hist"]) == 2
        b4 = await worker.get_batch(2, 3)  # nothing stale left: per-batch count resets
        m = worker.metrics()
        assert b4.dropped == 0 and m["staleness/dropped"] == 0.0 and m["data/dropped_groups"] == 4.0
        await worker.stop()

    run_virtual(main())


def test_the_staleness_drop_reports_the_length_bias_it_causes() -> None:
    """Long responses finish late, go stale and are dropped: `length/*` shows trained
    responses shorter than the ones the engines completed (a negative bias)."""
    eng = SimulatedEngine(length_fn=lambda p, i: 10 if p.prompt_ids[0] % 2 else 40, chunk=10)
    cfg = _cfg(groups_per_step=2, max_staleness=2, max_off_policy_steps=1, max_inflight=64)
    worker = RolloutDataWorker(cfg, _source(50), eng.generate)

    async def main() -> None:
        await worker.start()
        await asyncio.sleep(0.15)  # the short groups of v = 0 complete, the long ones run
        eng.set_version(3)
        worker.set_served_version(3)
        await asyncio.sleep(0.5)  # the long ones complete too, already too stale
        b = await worker.get_batch(2, 3)
        m = worker.metrics()
        assert b.dropped == 6 and m["data/dropped_groups"] == 6.0
        assert m["length/dropped_mean"] == pytest.approx((3 * 10 + 3 * 40) / 6)
        assert m["length/trained_mean"] == 10.0  # the batch: groups admitted at v = 3
        completed = (6 * 25.0 * 2 + 2 * 10 * 2) / (8 * 2)
        assert m["length/completed_mean"] == pytest.approx(completed)
        assert m["length/trained_bias"] == pytest.approx(10.0 / completed - 1.0)
        await worker.stop()

    run_virtual(main())


def test_oldest_unfinished_version_bounds_every_token_still_to_come() -> None:
    """What the forward-only role may release: once `oldest_unfinished_version()` said v, no
    sample finishing later carries a token older than v (a continued sample's kept tokens
    included), whether a push aborts and continues samples or updates them in place; and it
    moves up as the old samples finish."""
    eng = SimulatedEngine(length_fn=lambda p, i: 10 + 9 * i)
    cfg = _cfg(n_samples_per_prompt=3, groups_per_step=2, max_staleness=2, max_inflight=4)
    floors: list[int] = []
    finished: list[tuple[int, int]] = []  # (oldest token version, the floor said before)

    async def generate(req, priority, expected_len):
        res = await eng.generate(req, priority, expected_len)
        if res.status is FinishStatus.FINISHED:
            tokens = [*req.prefix_versions, *res.token_versions]
            finished.append((min(tokens), max(floors, default=0)))
        return res

    worker = RolloutDataWorker(cfg, _source(60), generate, abort_fn=eng.abort_all)

    async def main() -> None:
        await worker.start()
        for v in range(1, 8):
            await worker.get_batch(2, v - 1)
            floors.append(worker.oldest_unfinished_version())
            if v % 2:  # abort, continue later (the kept tokens carry v - 1)
                await worker.pause()
            eng.set_version(v)  # else in place: a running sample goes on under v
            worker.set_served_version(v)
            await worker.resume()
            floors.append(worker.oldest_unfinished_version())
            await asyncio.sleep(0.01)
            floors.append(worker.oldest_unfinished_version())
        await worker.stop()

    run_virtual(main())
    assert worker.metrics()["data/aborted"] > 0
    assert len(finished) > 40 and all(oldest >= floor for oldest, floor in finished)
    assert any(oldest > 0 and oldest == floor for oldest, floor in finished)  # it is tight
    assert floors == sorted(floors) and floors[-1] >= 5  # it advances with the pushes


def _pause_run(policy: str, *, abortable: bool) -> tuple[list, RolloutDataWorker, SimulatedEngine]:
    eng = SimulatedEngine(length_fn=lambda p, i: 40)
    cfg = _cfg(partial_rollout=policy, n_samples_per_prompt=2, groups_per_step=2, max_inflight=4)
    worker = RolloutDataWorker(
        cfg, _source(2), eng.generate, abort_fn=eng.abort_all if abortable else None
    )
    groups: list = []

    async def main() -> None:
        await worker.start()
        await asyncio.sleep(0.015)  # mid-generation
        await worker.pause()
        assert eng.active == 0 and worker.metrics()["data/inflight"] == 0
        eng.set_version(1)
        worker.set_served_version(1)
        await asyncio.sleep(0.05)  # nothing is dispatched while paused
        assert eng.active == 0
        await worker.resume()
        groups.extend((await worker.get_batch(2, 1)).groups)
        await worker.stop()

    run_virtual(main())
    return groups, worker, eng


def test_pause_continue_keeps_tokens_with_per_token_versions() -> None:
    groups, worker, eng = _pause_run("continue", abortable=True)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 4 and worker.metrics()["data/aborted"] == 4
    for s in samples:
        assert list(s.output_ids) == list(range(1000 * s.sample_index, 1000 * s.sample_index + 40))
        (v0, n0), (v1, n1) = s.token_versions.runs
        assert (v0, v1, n0 + n1) == (0, 1, 40) and 10 <= n0 <= 20
        assert s.min_version == 0 and s.attempts == 2 and len(s.payloads) == 2
    assert {c.prefix_len for c in eng.calls if c.attempt == 1} == {
        s.token_versions.runs[0][1] for s in samples
    }
    assert all(g.min_version == 0 and g.max_version == 1 for g in groups)


def test_pause_requeue_regenerates_whole_samples() -> None:
    groups, worker, eng = _pause_run("requeue", abortable=True)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 4 and worker.metrics()["data/aborted"] == 4
    for s in samples:
        assert list(s.output_ids) == list(range(1000 * s.sample_index, 1000 * s.sample_index + 40))
        assert s.token_versions.runs == ((1, 40),) and s.min_version == 1
        assert s.attempts == 2 and len(s.payloads) == 1
    assert {c.prefix_len for c in eng.calls} == {0}


def test_pause_without_abort_hook_waits_for_running_generations() -> None:
    groups, worker, _ = _pause_run("continue", abortable=False)
    samples = [s for g in groups for s in g.samples]
    assert worker.metrics()["data/aborted"] == 0
    assert all(s.token_versions.runs == ((0, 40),) for s in samples)


def test_group_filter_refills_with_fresh_prompts() -> None:
    eng = SimulatedEngine(length_fn=lambda p, i: 10, chunk=10)
    worker = RolloutDataWorker(
        _cfg(groups_per_step=2, max_staleness=0),
        _source(20),
        eng.generate,
        group_filter=lambda g: int(g.prompt.key[1:]) % 2 == 0,
    )

    async def main() -> None:
        await worker.start()
        batch = await worker.get_batch(2, 0)  # S = 0: only 2 live groups at a time
        assert [g.prompt.key for g in batch.groups] == ["p0", "p2"]
        assert batch.filtered == 1  # p1 was rejected and replaced by p2
        acc = worker.accounting()
        assert acc.filtered == 1 and acc.consumed == 2 and acc.balanced
        await worker.stop()

    run_virtual(main())


def test_generate_errors_are_retried_then_fail_the_worker() -> None:
    flaky = SimulatedEngine(length_fn=lambda p, i: 5, chunk=5, fail_fn=lambda r: r.attempt == 0)
    w1 = RolloutDataWorker(_cfg(), _source(4), flaky.generate)
    broken = SimulatedEngine(length_fn=lambda p, i: 5, fail_fn=lambda r: r.prompt.key == "p1")
    w2 = RolloutDataWorker(_cfg(max_generate_retries=2), _source(4), broken.generate)

    async def main() -> None:
        await w1.start()
        batch = await w1.get_batch(2, 0)
        assert all(s.attempts == 2 for g in batch.groups for s in g.samples)
        assert w1.metrics()["data/generate_errors"] >= 4
        await w1.stop()
        await w2.start()
        with pytest.raises(
            RuntimeError, match=r"generate raised 3 times for prompt 'p1'.*max_generate_retries=2"
        ):
            for _ in range(2):
                await w2.get_batch(2, 0)
        await w2.stop()

    run_virtual(main())


def test_malformed_generate_result_fails_with_a_clear_error() -> None:
    async def bad(req, priority, expected_len):
        return GenerationResult(output_ids=[1, 2, 3], token_versions=[0])

    worker = RolloutDataWorker(_cfg(), _source(2), bad)

    async def main() -> None:
        await worker.start()
        with pytest.raises(RuntimeError, match="one version per new token"):
            await worker.get_batch(1, 0)
        await worker.stop()

    run_virtual(main())


def test_misuse_errors() -> None:
    eng = SimulatedEngine(length_fn=lambda p, i: 5, chunk=5)
    worker = RolloutDataWorker(_cfg(groups_per_step=1, max_staleness=0), _source(10), eng.generate)
    with pytest.raises(TypeError, match="DataWorkerConfig"):
        RolloutDataWorker({"n": 1}, _source(1), eng.generate)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PromptSource"):
        RolloutDataWorker(_cfg(), [Prompt(key="a", prompt_ids=[1])], eng.generate)  # type: ignore[arg-type]

    async def main() -> None:
        with pytest.raises(RuntimeError, match="before start"):
            await worker.get_batch(1, 0)
        await worker.start()
        with pytest.raises(ValueError, match="num_groups"):
            await worker.get_batch(0, 0)
        await worker.get_batch(1, 0)
        # trainer moved to version 1 but the engines still serve 0 and S = 0: can never fill
        with pytest.raises(RuntimeError, match="set_served_version"):
            await worker.get_batch(1, 1)
        worker.set_served_version(1)
        assert len((await worker.get_batch(1, 1)).groups) == 1
        with pytest.raises(ValueError, match="backwards"):
            worker.set_served_version(0)
        with pytest.raises(RuntimeError, match="before start"):
            worker.load_state_dict(worker.state_dict())
        await worker.stop()

    run_virtual(main())


def test_finite_source_ends_with_a_partial_batch() -> None:
    eng = SimulatedEngine(length_fn=lambda p, i: 5, chunk=5)
    worker = RolloutDataWorker(_cfg(groups_per_step=2), _source(5), eng.generate)

    async def main() -> None:
        await worker.start()
        sizes = []
        while True:
            b = await worker.get_batch(2, 0)
            sizes.append(len(b.groups))
            if b.end_of_data:
                break
        assert sizes == [2, 2, 1]
        assert worker.accounting().consumed == 5
        await worker.stop()

    run_virtual(main())


@pytest.mark.parametrize("delay", [0.0, 0.01])
def test_stop_cancels_and_keeps_every_group_accounted(delay: float) -> None:
    # delay 0: tasks are cancelled before their first step (generate never ran)
    eng = SimulatedEngine(length_fn=lambda p, i: 100)
    worker = RolloutDataWorker(_cfg(), _source(30), eng.generate)

    async def main() -> None:
        await worker.start()
        if delay:
            await asyncio.sleep(delay)
        await worker.stop()
        acc = worker.accounting()
        assert acc.pending > 0 and acc.balanced and eng.active == 0
        assert worker.metrics()["data/inflight"] == 0

    run_virtual(main())


async def test_runs_on_a_real_event_loop() -> None:
    eng = SimulatedEngine(length_fn=lambda p, i: 3 + int(p.key[1:]) % 4, token_time=2e-4)
    worker = RolloutDataWorker(
        _cfg(n_samples_per_prompt=3, fifo_window=2), _source(12), eng.generate
    )
    await worker.start()
    seen = []
    for k in range(6):
        batch = await worker.get_batch(2, k, timeout=20)
        seen.extend(g.prompt.key for g in batch.groups)
        eng.set_version(k + 1)
        worker.set_served_version(k + 1)
    await worker.stop()
    assert sorted(seen) == sorted(f"p{i}" for i in range(12))
    assert worker.accounting().balanced and worker.metrics()["timing/trainer_wait"] >= 0.0


def test_metrics_keys_and_values() -> None:
    eng = SimulatedEngine(length_fn=lambda p, i: 10 + 10 * int(p.key[1:]), chunk=5)
    worker = RolloutDataWorker(_cfg(fifo_window=2, max_inflight=2), _source(8), eng.generate)
    documented = {
        "data/queue_depth",
        "data/waiting_probe",
        "data/inflight",
        "data/eligible_groups",
        "data/blocked_groups",
        "data/head_lag",
        "data/live_groups",
        "data/admission_limit",
        "data/probe_hit_rate",
        "data/dispatched_groups",
        "data/consumed_groups",
        "data/filtered_groups",
        "data/pending_groups",
        "data/generate_calls",
        "data/aborted",
        "data/generate_errors",
        "staleness/mean",
        "staleness/max",
        "staleness/dropped",
        "staleness/hist",
        "data/dropped_groups",
        "timing/dispatch_wait",
        "timing/trainer_wait",
    }

    async def main() -> None:
        await worker.start()
        m0 = worker.metrics()
        assert documented <= set(m0) and m0.pop("staleness/hist") == []
        assert all(isinstance(v, float) for v in m0.values())
        assert m0["data/inflight"] == 2 and m0["data/admission_limit"] == (4 + 0 + 1) * 2
        assert m0["data/live_groups"] == m0["data/dispatched_groups"] <= 10
        batch = await worker.get_batch(2, 0)
        eng.set_version(1)
        worker.set_served_version(1)
        m1 = worker.metrics()
        assert m1["timing/trainer_wait"] == pytest.approx(batch.wait_s) and batch.wait_s > 0
        assert m1["timing/dispatch_wait"] > 0  # max_inflight = 2: samples waited in the queue
        assert m1["data/consumed_groups"] == 2 and m1["data/admission_limit"] == 12
        assert m1["data/head_lag"] == m1["data/dispatched_groups"] - 2
        await worker.stop()

    run_virtual(main())
