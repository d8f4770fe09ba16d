"""The dispatch simulator with pipelines (scripts/simulate_pipelines.py) at a tiny scale: one
pipeline gives exactly the single-pipeline simulator's result, two identical pipelines share
the pool fairly under the real scheduler core, and the simulator's decisions are the ones the
scheduler actor's core makes on the same reports."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from slime_async.orchestrator import pipeline_scheduler

pytestmark = pytest.mark.timeout(120)

_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sim():
    sd = _load("simulate_dispatch")
    _load("sim_pool"), _load("sim_member")
    return sd, _load("simulate_pipelines")


@pytest.fixture(scope="module")
def jain(sim):
    return _load("bench_sim_pipelines").jain


def _cfg(sd, **kw):
    base = dict(
        engines=4, slots=8, prompts=200, n=4, groups_per_step=8, max_staleness=2,
        max_off_policy_steps=None, train_step_s=30.0, steps=10,
    )  # fmt: skip
    return sd.SimConfig(**{**base, **kw})


@pytest.mark.parametrize("arm", ["exclusive", "shared"])
def test_one_pipeline_equals_the_single_pipeline_simulator(sim, arm) -> None:
    sd, sp = sim
    cfg = _cfg(sd)
    policy = sd.Policy(name="arrival", window=math.inf, probe=False)
    want = sd.simulate(cfg, policy)
    got = sp.simulate_pool(arm, sp.PoolConfig(engine_slots=4, trainer_devices=1), [cfg], policy)
    p = got.pipes[0]
    assert (got.sim_s, p.trained_samples, p.idle_s) == (
        want.sim_s,
        want.trained_samples,
        want.idle_s,
    )
    assert p.staleness == want.staleness and p.slot_util == want.slot_util
    assert got.preempted == 0


def _two(sd, sp, **pool_kw):
    cfg = _cfg(sd, min_len=200, max_len=1000, slots=8, steps=10**9, groups_per_step=4)
    cfgs = [cfg, dataclasses.replace(cfg, seed=1)]
    pool = sp.PoolConfig(engine_slots=4, trainer_devices=1, horizon_s=1800.0, **pool_kw)
    return sp.simulate_pool("shared", pool, cfgs)


def test_two_identical_pipelines_share_fairly_and_neither_starves(sim, jain) -> None:
    sd, sp = sim
    r = _two(sd, sp, heartbeat_s=1.0, min_hold_s=30.0, sleep_s=1.0, wake_s=1.0, sync_s=0.5)
    grants = [p.granted_s for p in r.pipes]
    assert sum(grants) > 0.8 * 4 * r.sim_s  # slots are held most of the time
    assert jain(grants) >= 0.95, grants
    steps = [p.steps for p in r.pipes]
    assert min(steps) >= 5 and min(steps) >= 0.5 * max(steps), steps
    assert all(p.dropped_at is None for p in r.pipes) and r.engine_switch_s > 0


def test_the_simulator_drives_the_scheduler_actors_core(sim, monkeypatch) -> None:
    """Every report and release the simulator made, replayed on a fresh core of the actor's
    module, gives the same answers and the same grant history."""
    sd, sp = sim
    assert sp.SchedulerCore is pipeline_scheduler.SchedulerCore
    calls: list[tuple] = []

    class Recording(sp.SchedulerCore):
        def join(self, name, **kw):
            out = super().join(name, **kw)
            calls.append(("join", name, kw, out))
            return out

        def report(self, name, **kw):
            out = super().report(name, **kw)
            calls.append(("report", name, kw, out))
            return out

        def released(self, name, slot, **kw):
            calls.append(("released", name, {"slot": slot, **kw}, None))
            return super().released(name, slot, **kw)

    monkeypatch.setattr(sp, "SchedulerCore", Recording)
    r = _two(sd, sp, heartbeat_s=1.0, min_hold_s=30.0, sleep_s=1.0, wake_s=1.0)
    assert sum(p.switches for p in r.pipes) > 4
    replay = pipeline_scheduler.SchedulerCore(
        pipeline_scheduler.PipelineSchedulerConfig(
            slots=4, min_hold_s=30.0, heartbeat_timeout_s=10.0, min_pipelines=2
        )
    )
    for what, name, kw, out in calls:
        if what == "released":
            replay.released(name, kw.pop("slot"), **kw)
        else:
            assert getattr(replay, what)(name, **kw) == out
    grants = [e for e in replay.events if "granted" in e[2]]
    assert len(grants) > 4


def test_a_hung_member_is_fenced_and_rejoins_and_no_device_holds_two_engines(sim) -> None:
    """A pipeline whose reports hang is dropped; its member puts its engines to sleep on its
    own and joins again when the reports come back; the others go on; at no moment are two
    pipelines' engines awake on one accelerator (`Pool` raises `DoubleOccupancy`)."""
    sd, sp = sim
    kw = dict(heartbeat_s=1.0, min_hold_s=30.0, sleep_s=30.0, wake_s=1.0, sync_s=0.5)
    stall = ("a", 300.0, 360.0)
    r = _two(sd, sp, heartbeat_timeout_s=10.0, fence_s=45.0, stall=stall, **kw)
    a, b = r.pipes
    assert a.fences == 1 and a.rejoins == 1 and a.dropped_at is not None
    assert b.rejoins == 0 and min(a.steps, b.steps) >= 5
    pool = sp.Pool(1, 4)
    pool.load(0, "a")
    with pytest.raises(sp.DoubleOccupancy, match="resident"):
        pool.load(0, "b")


def test_spread_lends_idle_slots_and_decodes_faster_without_double_occupancy(sim) -> None:
    """Two synchronous pipelines (S 0) of 16 requests a step on 4 engines of 32 places: the
    demand-capped policy gives each one engine (its need); with `spread` the two slots nobody
    needs are lent, a pipeline's requests spread over more engines and decode faster (the
    simulated engine's step time grows with its running requests), so it trains more steps in
    the same time; neither is slower, and no accelerator ever holds two engines (`Pool`
    raises `DoubleOccupancy`)."""
    sd, sp = sim
    kw = dict(heartbeat_s=1.0, min_hold_s=5.0, sleep_s=1.0, wake_s=1.0, sync_s=0.5)
    cfg = _cfg(sd, min_len=200, max_len=4000, slots=32, steps=10**9, groups_per_step=4,
               max_staleness=0, train_step_s=60.0)  # fmt: skip
    cfgs = [cfg, dataclasses.replace(cfg, seed=1)]
    arms = {}
    for spread in (False, True):
        pool = sp.PoolConfig(engine_slots=4, trainer_devices=1, horizon_s=1800.0, spread=spread,
                             **kw)  # fmt: skip
        arms[spread] = sp.simulate_pool("shared", pool, cfgs)
    capped, spread = arms[False], arms[True]
    assert [round(p.granted_s / 1800) for p in capped.pipes] == [1, 1]
    assert sum(round(p.granted_s / 1800) for p in spread.pipes) == 4
    assert all(x.steps >= y.steps for x, y in zip(spread.pipes, capped.pipes))
    assert sum(p.steps for p in spread.pipes) > sum(p.steps for p in capped.pipes)
    assert spread.preempted == capped.preempted == 0


def test_overlap_trainer_devices_generate_between_steps_never_beside_their_trainer(sim) -> None:
    """Partial overlap in the simulator: two synchronous pipelines, each on one engine slot and
    two trainer devices. With overlap their trainer devices serve their generation between
    their steps (through the real core's trainer hooks), so each step's requests spread over
    three engines instead of one and each pipeline trains more steps in the same time; the
    trainer waits for the engines there to sleep before every step, and no device ever holds
    an engine beside its trainer (`Pool` raises `DoubleOccupancy`: the trainer is resident)."""
    sd, sp = sim
    cfg = _cfg(sd, min_len=200, max_len=600, slots=8, steps=10**9, groups_per_step=16,
               max_staleness=0, train_step_s=30.0)  # fmt: skip
    cfgs = [cfg, dataclasses.replace(cfg, seed=1)]
    kw = dict(engine_slots=2, trainer_devices=2, horizon_s=1800.0, heartbeat_s=1.0,
              min_hold_s=5.0, sleep_s=1.0, wake_s=1.0, sync_s=0.5, trainer_swap_s=1.0)  # fmt: skip
    alone = sp.simulate_pool("exclusive", sp.PoolConfig(**kw), cfgs)
    over = sp.simulate_pool("exclusive", sp.PoolConfig(overlap=True, **kw), cfgs)
    assert over.engine_slots == 6 and alone.engine_slots == 2
    for x, y in zip(over.pipes, alone.pipes):
        assert x.steps > 1.3 * y.steps, (x.steps, y.steps)
        assert x.granted_s > 1.5 * y.granted_s  # its trainer devices served too
        assert x.trainer_wait_s > 0 and x.switches > 2 * x.steps  # slept and woke every step
    pool = sp.Pool(1, 4)
    pool.load(0, "a")
    with pytest.raises(sp.DoubleOccupancy, match="resident"):
        pool.load(0, "a:trainer")
