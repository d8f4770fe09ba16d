"""Smoke tests of scripts/simulate_dispatch.py at a tiny scale (the real worker in virtual time)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from data_worker import worst_case_staleness

pytestmark = pytest.mark.timeout(120)

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "simulate_dispatch.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("simulate_dispatch", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["simulate_dispatch"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_versions_split_at_weight_updates(sim) -> None:
    cfg = sim.SimConfig(engines=1, prompts=4)
    cluster = sim.Cluster(cfg, sim.Workload(cfg))
    cluster.set_version(1, 10.0)
    cluster.set_version(2, 20.0)
    # 30 tokens at 1 s each from t=5: tokens before t=10 -> v0, before t=20 -> v1, rest v2
    runs = cluster._versions(5.0, 1.0, 30)
    assert runs.runs == ((0, 5), (1, 10), (2, 15))
    assert cluster._versions(25.0, 1.0, 3).runs == ((2, 3),)


def test_tiny_simulation_respects_the_worker_contract(sim) -> None:
    cfg = sim.SimConfig(
        engines=4,
        slots=8,
        prompts=200,
        n=4,
        groups_per_step=8,
        max_staleness=2,
        max_off_policy_steps=None,
        train_step_s=30.0,
        steps=10,
    )
    B = cfg.groups_per_step
    results = {
        name: sim.simulate(cfg, sim.Policy(name=name, window=w, probe=p))
        for name, w, p in [("arrival", math.inf, False), ("strict", 1, False), ("probe", B, True)]
    }
    for r in results.values():
        assert r.trained_samples == cfg.steps * B * cfg.n
        assert r.sim_s > 0 and 0.0 <= r.idle_s <= r.sim_s and 0.0 < r.slot_util <= 1.0
        assert len(r.batch_bias) == cfg.steps and r.dropped == 0
    for name, w in (("strict", 1), ("probe", B)):
        bound = worst_case_staleness(max_staleness=2, fifo_window=w, groups_per_step=B)
        assert max(results[name].staleness) <= bound
    md = sim.table(list(results.values()), cfg)
    assert md.count("\n| ") == 3 and "| arrival |" in md
