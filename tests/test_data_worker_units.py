"""Unit tests of the data worker's pure parts: config errors, versions, source, budget, window."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from data_worker import (
    DataWorkerConfig,
    FifoWindow,
    InMemoryPromptSource,
    LengthCache,
    PartialRolloutPolicy,
    VersionRuns,
    admission_limit,
    snapshot_count,
    staleness_bound,
    window_slack_steps,
    worst_case_staleness,
)
from data_worker.virtual_loop import VirtualDeadlock, run_virtual


# ---------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("fifo_window", 0, "fifo_window (W) must be >= 1"),
        ("fifo_window", 0.5, "fifo_window (W) must be >= 1"),
        ("fifo_window", 2.5, "whole number"),
        ("fifo_window", math.nan, "fifo_window (W)"),
        ("n_samples_per_prompt", 0, "n_samples_per_prompt must be an integer >= 1"),
        ("max_staleness", -1, "max_staleness (S) must be an integer >= 0"),
        ("groups_per_step", 0, "groups_per_step (B)"),
        ("max_off_policy_steps", -2, "max_off_policy_steps"),
        ("partial_rollout", "keep", "'continue' or 'requeue'"),
        ("length_ema_alpha", 0.0, "length_ema_alpha"),
        ("max_inflight", 0, "max_inflight"),
        ("default_expected_len", 0, "default_expected_len"),
    ],
)
def test_bad_settings_name_the_problem(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        DataWorkerConfig(**{field: value})
    assert needle in str(info.value)


def test_config_accepts_inf_window_and_policy_strings() -> None:
    cfg = DataWorkerConfig(fifo_window=math.inf, partial_rollout="requeue")  # type: ignore[arg-type]
    assert cfg.partial_rollout is PartialRolloutPolicy.REQUEUE
    assert cfg.queued_limit == cfg.max_inflight and cfg.bucket_groups == cfg.groups_per_step


# ---------------------------------------------------------------- VersionRuns
def test_version_runs_roundtrip_and_concat() -> None:
    a = VersionRuns.from_sequence([2, 2, 3])
    b = VersionRuns.constant(3, 2) + VersionRuns.from_sequence([4])
    c = a + b
    assert list(c) == [2, 2, 3, 3, 3, 4]
    assert c.runs == ((2, 2), (3, 3), (4, 1))
    assert (c.min(), c.max(), len(c), c[3], c[-1]) == (2, 4, 6, 3, 4)
    assert VersionRuns.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert c == [2, 2, 3, 3, 3, 4]
    assert VersionRuns().min() is None and len(VersionRuns()) == 0
    with pytest.raises(IndexError):
        c[6]


# ---------------------------------------------------------------- prompt source
def test_source_epochs_keys_and_resumable_cursor() -> None:
    items = [{"prompt_ids": [i], "key": f"k{i}"} for i in range(5)]
    src = InMemoryPromptSource(items, num_epochs=3, shuffle=True, seed=7)
    seen = []
    for _ in range(7):
        seen.append(src.next_prompt())
    state = json.loads(json.dumps(src.state_dict()))
    rest = list(iter(src.next_prompt, None))
    assert len(seen) + len(rest) == 15
    assert sorted(p.key for p in seen[:5]) == [f"k{i}" for i in range(5)]
    assert [p.epoch for p in seen] == [0] * 5 + [1, 1]
    assert [p.key for p in seen[:5]] != [p.key for p in seen[5:7] + rest[:3]]  # reshuffled
    again = InMemoryPromptSource(items, num_epochs=3, shuffle=True, seed=7)
    again.load_state_dict(state)
    assert [(p.key, p.epoch) for p in iter(again.next_prompt, None)] == [
        (p.key, p.epoch) for p in rest
    ]


def test_source_errors() -> None:
    with pytest.raises(ValueError, match="unique"):
        InMemoryPromptSource([{"prompt_ids": [1], "key": "a"}, {"prompt_ids": [2], "key": "a"}])
    with pytest.raises(ValueError, match="prompt_ids"):
        InMemoryPromptSource([{"ids": [1]}])
    with pytest.raises(ValueError, match="num_epochs"):
        InMemoryPromptSource([{"prompt_ids": [1]}], num_epochs=0)
    src = InMemoryPromptSource([{"prompt_ids": [1]}])
    with pytest.raises(ValueError, match="same dataset"):
        src.load_state_dict({"epoch": 0, "pos": 0, "size": 2})


# ---------------------------------------------------------------- budget + cache
def test_budget_formulas() -> None:
    assert admission_limit(max_staleness=0, served_version=0, groups_per_step=4) == 4
    assert admission_limit(max_staleness=2, served_version=5, groups_per_step=3) == 24
    assert window_slack_steps(fifo_window=1, groups_per_step=4) == 0
    assert window_slack_steps(fifo_window=5, groups_per_step=4) == 1
    assert window_slack_steps(fifo_window=6, groups_per_step=4) == 2
    assert worst_case_staleness(max_staleness=1, fifo_window=8, groups_per_step=8) == 2
    assert worst_case_staleness(max_staleness=1, fifo_window=math.inf, groups_per_step=8) == (
        math.inf
    )


def test_staleness_bound_and_snapshot_count_by_hand() -> None:
    """Hand-derived: S 2, W 16, B 8 -> 2 + ceil(15 / 8) = 4; a cap N below it wins; no push
    interval enters the bound. Snapshots: every version k - 4 .. k -> 5; only versions pushed
    every I -> floor(4 / I) + 1 on the grid + 1 off it (I 2: 4, I 3: 3, I 4: 3, I 8: 2)."""
    win = {"max_staleness": 2, "fifo_window": 16, "groups_per_step": 8}
    assert staleness_bound(**win) == 4
    assert staleness_bound(**win, max_off_policy_steps=3) == 3
    assert staleness_bound(**win, max_off_policy_steps=9) == 4
    assert staleness_bound(max_staleness=3, fifo_window=1, groups_per_step=8) == 3
    assert math.isinf(staleness_bound(max_staleness=1, fifo_window=math.inf, groups_per_step=8))
    assert (
        staleness_bound(
            max_staleness=1, fifo_window=math.inf, groups_per_step=8, max_off_policy_steps=5
        )
        == 5
    )
    assert [snapshot_count(bound=4, versions_every=i) for i in (1, 2, 3, 4, 8)] == [5, 4, 3, 3, 2]
    assert snapshot_count(bound=1, versions_every=2) == 2  # never more than bound + 1
    assert math.isinf(snapshot_count(bound=math.inf, versions_every=1))


def test_length_cache_ema() -> None:
    c = LengthCache(alpha=0.25)
    assert c.get("a") is None
    c.update("a", 100)
    assert c.update("a", 200) == pytest.approx(125.0)
    d = LengthCache(alpha=0.25)
    d.load_json(json.loads(json.dumps(c.to_json())))
    assert d.get("a") == pytest.approx(125.0) and "a" in d and len(d) == 1


# ---------------------------------------------------------------- window
def test_window_eligibility_and_head_advance() -> None:
    w = FifoWindow(window=3)
    for seq in (4, 2, 3, 1):
        w.on_complete(seq)
    # head 0: window [0, 3) -> only 2 and 1 eligible, in completion order
    assert (w.num_eligible, w.num_blocked) == (2, 2)
    assert w.pop_eligible() == 2 and w.pop_eligible() == 1 and w.pop_eligible() is None
    w.release(2)
    w.release(1)
    assert w.head == 0 and w.num_eligible == 0  # 0 still outstanding
    w.on_complete(0)
    assert w.pop_eligible() == 0
    w.release(0)  # head jumps over the released 1 and 2 -> 3; window [3, 6)
    assert w.head == 3
    assert [w.pop_eligible(), w.pop_eligible()] == [4, 3]  # completion order
    with pytest.raises(ValueError, match="released twice"):
        w.release(1)


def test_window_one_is_strict_order_and_inf_is_arrival_order() -> None:
    strict = FifoWindow(window=1)
    arrival = FifoWindow(window=math.inf)
    for seq in (2, 0, 1):
        strict.on_complete(seq)
        arrival.on_complete(seq)
    out_s, out_a = [], []
    for w, out in ((strict, out_s), (arrival, out_a)):
        while (s := w.pop_eligible()) is not None:
            out.append(s)
            w.release(s)
    assert out_s == [0, 1, 2]
    assert out_a == [2, 0, 1]


# ---------------------------------------------------------------- virtual loop
def test_virtual_loop_is_fast_and_detects_deadlock() -> None:
    async def long_sleep() -> float:
        await asyncio.sleep(10_000.0)
        return asyncio.get_running_loop().time()

    assert run_virtual(long_sleep()) == pytest.approx(10_000.0)

    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(VirtualDeadlock):
        run_virtual(stuck())


# ---------------------------------------------------------------- fast constructors
def test_fast_constructors_match_the_dataclasses() -> None:
    import dataclasses

    from data_worker import GenerationRequest, Group, Prompt, Sample
    from data_worker.records import (
        GROUP_FIELDS,
        REQUEST_FIELDS,
        SAMPLE_FIELDS,
        make_group,
        make_request,
        make_sample,
    )

    # every field is set (a field added later must be added to the fast path too)
    assert set(REQUEST_FIELDS) == {f.name for f in dataclasses.fields(GenerationRequest)}
    assert set(SAMPLE_FIELDS) == {f.name for f in dataclasses.fields(Sample)}
    assert set(GROUP_FIELDS) == {f.name for f in dataclasses.fields(Group)}
    p = Prompt(key="k", prompt_ids=[1, 2], payload={"label": 3})
    runs = VersionRuns.constant(2, 3)
    fast = make_request(p, 7, 1, [5, 6], runs, ({"a": 1},), 2)
    slow = GenerationRequest(
        prompt=p,
        group_seq=7,
        sample_index=1,
        prefix_ids=[5, 6],
        prefix_versions=runs,
        prefix_payloads=({"a": 1},),
        attempt=2,
    )
    assert fast == slow and type(fast) is GenerationRequest
    s_fast = make_sample(1, [4, 4, 4], runs, ({},), 2, 1)
    assert s_fast == Sample(
        sample_index=1,
        output_ids=[4, 4, 4],
        token_versions=runs,
        payloads=({},),
        min_version=2,
        attempts=1,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        s_fast.attempts = 3  # type: ignore[misc]
    g_fast = make_group(3, p, (s_fast,), 2, 2, 1, 4.5)
    assert g_fast == Group(
        seq=3,
        prompt=p,
        samples=(s_fast,),
        min_version=2,
        max_version=2,
        admitted_version=1,
        completed_at=4.5,
    )
