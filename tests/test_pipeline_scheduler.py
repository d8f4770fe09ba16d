"""The pipeline scheduler's policy and state machine (pure, with a given clock): demand-driven,
priority-weighted time-sharing of slots, hand-overs only after the holder released its engine,
and a pipeline that leaves or goes silent loses its slots without stopping the others."""

from __future__ import annotations

import pytest

from slime_async.config.pipeline import PipelineConfig, PipelineSchedulerConfig
from slime_async.orchestrator.pipeline_scheduler import SchedulerCore


def _core(**kw) -> SchedulerCore:
    return SchedulerCore(PipelineSchedulerConfig(**{"slots": 1, "min_hold_s": 2.0, **kw}))


def _simulate(core: SchedulerCore, demand: dict[str, int], *, until: float, dt: float = 0.5):
    """Both pipelines report every `dt`; a give-up is released at once. Returns slot-seconds
    each pipeline served slot 0."""
    served = dict.fromkeys(demand, 0.0)
    t = 0.0
    while t < until:
        for name in demand:
            todo = core.report(name, demand=demand[name], version=0, now=t)
            for slot in todo["give_up"]:
                core.released(name, slot, now=t)
        holder = core.owner[0]
        if holder is not None:
            served[holder] += dt
        t += dt
    return served


def test_two_wanting_pipelines_alternate_by_priority() -> None:
    core = _core()
    core.join("a", priority=2.0, slots=[0], now=0.0)
    core.join("b", priority=1.0, slots=[0], now=0.0)
    served = _simulate(core, {"a": 8, "b": 8}, until=120.0)
    # a hand-over may leave the slot free until the next report (the release, then the grant)
    assert 0.9 * 120.0 <= served["a"] + served["b"] <= 120.0
    assert served["a"] / served["b"] == pytest.approx(2.0, rel=0.15)
    grants = [e for e in core.events if "granted" in e[2]]
    assert len(grants) > 10  # the slot alternated (partial overlap over time)


def test_a_slot_goes_where_the_demand_is_and_moves_only_after_release() -> None:
    core = _core(heartbeat_timeout_s=100.0)
    core.join("a", priority=1.0, slots=[0], now=0.0)
    core.join("b", priority=1.0, slots=[0], now=0.0)
    assert core.report("a", demand=5, version=0, now=0.0)["take"] == [0]
    assert core.report("b", demand=0, version=0, now=0.1)["serve"] == []
    # a keeps it while b wants nothing, even after the hold time
    assert core.report("a", demand=5, version=1, now=10.0)["serve"] == [0]
    # a stops wanting, nobody else wants: a keeps it
    assert core.report("a", demand=0, version=1, now=10.5)["serve"] == [0]
    # b wants: a is asked to give it up; b is not granted until a released
    assert core.report("b", demand=3, version=0, now=10.6) == {
        "serve": [],
        "give_up": [],
        "take": [],
    }
    assert core.report("a", demand=0, version=1, now=10.65)["give_up"] == [0]
    core.released("a", 0, now=10.7)
    assert core.report("b", demand=3, version=0, now=10.8)["take"] == [0]
    assert core.owner == {0: "b"}


def test_a_silent_or_leaving_pipeline_loses_its_slots_at_once() -> None:
    core = _core(heartbeat_timeout_s=5.0, slots=2)
    core.join("a", priority=1.0, slots=[0, 1], now=0.0)
    core.join("b", priority=1.0, slots=[0], now=0.0)
    assert core.report("a", demand=4, version=0, now=0.0)["take"] == [0, 1]
    # a goes silent (crashed or hung): b gets slot 0 without a release from a
    assert core.report("b", demand=4, version=0, now=3.0)["take"] == []
    assert core.report("b", demand=4, version=0, now=6.0)["take"] == [0]
    assert "a" not in core.pipelines and core.owner == {0: "b", 1: None}
    assert any("silent" in e[2] for e in core.events)
    with pytest.raises(KeyError, match="not joined"):
        core.report("a", demand=1, version=0, now=7.0)
    core.leave("b", now=8.0)
    assert core.owner == {0: None, 1: None}


def test_bad_joins_and_configs_name_the_fix() -> None:
    core = _core()
    core.join("a", priority=1.0, slots=[0], now=0.0)
    with pytest.raises(ValueError, match="--pipeline-name"):
        core.join("a", priority=1.0, slots=[0], now=0.0)
    with pytest.raises(ValueError, match="outside the pool"):
        core.join("c", priority=1.0, slots=[3], now=0.0)
    with pytest.raises(ValueError, match="sleep_level"):
        PipelineSchedulerConfig(sleep_level=3)
    with pytest.raises(ValueError, match="heartbeat_s"):
        PipelineConfig(heartbeat_s=0)


def test_no_grant_before_min_pipelines_joined() -> None:
    core = _core(min_pipelines=2)
    core.join("a", priority=1.0, slots=[0], now=0.0)
    assert core.report("a", demand=4, version=0, now=0.0)["take"] == []
    core.join("b", priority=1.0, slots=[0], now=1.0)
    assert core.report("a", demand=4, version=0, now=1.0)["take"] == [0]
    core.leave("b", now=2.0)  # once gathered, a leave holds nothing back
    assert core.report("a", demand=4, version=0, now=2.0)["serve"] == [0]


def test_a_grant_made_in_another_pipelines_report_reaches_its_pipeline() -> None:
    """A slot freed and granted to b while a reports is in b's next `take` (else b never wakes
    its engine there and the slot idles until the hold runs out)."""
    core = _core(heartbeat_timeout_s=100.0)
    core.join("a", priority=1.0, slots=[0], now=0.0)
    core.join("b", priority=1.0, slots=[0], now=0.0)
    assert core.report("a", demand=5, version=0, now=0.0)["take"] == [0]
    assert core.report("b", demand=3, version=0, now=3.0)["take"] == []
    assert core.report("a", demand=5, version=0, now=3.5)["give_up"] == [0]
    core.released("a", 0, now=3.6)
    # a reports first after its release: the free slot goes to b (less served) in a's report
    assert core.report("a", demand=5, version=0, now=4.0)["take"] == []
    assert core.owner[0] == "b"
    todo = core.report("b", demand=3, version=0, now=4.5)
    assert todo["take"] == [0] and todo["serve"] == [0]
    assert core.report("b", demand=3, version=0, now=5.0)["take"] == []  # delivered once
