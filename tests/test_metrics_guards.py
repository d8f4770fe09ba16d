"""Divergence guards fire on the patterns they watch for, and stay quiet on healthy runs."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from data_worker.config import DataWorkerConfig, data_worker_config_from_record
from slime_async.metrics.detectors import (
    entropy_spike,
    is_weight_out_of_range,
    logprob_diff_drift,
    trend_drop,
    window_mean_below,
)
from slime_async.metrics.guards import (
    BASELINE_AFTER_BOUNDS,
    GuardConfig,
    GuardKind,
    GuardMonitor,
    run_guard_config,
    saved_run_guard_config,
    scan,
    staleness_fill_steps,
)

CFG = GuardConfig(persist_steps=1, diff_window=5, is_lower=0.8)
"""The detectors' maths with short windows (persistence and the calibrated defaults are
tested below)."""


def healthy(n: int = 60, seed: int = 0) -> list[dict]:
    """A noisy but healthy run: entropy and lp-diff flat, IS means near 1, log-prob rising."""
    rng = random.Random(seed)
    out = []
    for k in range(1, n + 1):
        out.append(
            {
                "step": k,
                "policy/entropy": 1.2 - 0.005 * k + rng.gauss(0, 0.03),
                "mismatch/train_rollout_logprob_abs_diff": 0.01 + rng.gauss(0, 0.001),
                "is/staleness/mean": 1.0 + rng.gauss(0, 0.02),
                "is/engine/mean": 1.0 + rng.gauss(0, 0.01),
                "is/combined/mean": 1.0 + rng.gauss(0, 0.03),
                "rollout/logprob_mean": -1.0 + 0.004 * k + rng.gauss(0, 0.02),
                "is/staleness/ess": 0.95 + rng.gauss(0, 0.02),
                "train/grad_cosine": 0.1 + rng.gauss(0, 0.1),
            }
        )
    return out


def test_healthy_run_fires_nothing() -> None:
    for seed in range(5):
        assert scan(healthy(seed=seed), CFG) == []


def test_entropy_spike() -> None:
    assert entropy_spike([1.0] * 10 + [2.0], window=10, factor=1.5, min_delta=0.1) == (2.0, 1.5)
    assert entropy_spike([1.0] * 10 + [1.4], window=10, factor=1.5, min_delta=0.1) is None
    # tiny entropies: the absolute floor keeps noise from firing
    assert entropy_spike([0.01] * 10 + [0.05], window=10, factor=1.5, min_delta=0.1) is None
    assert (
        entropy_spike([1.0, 3.0], window=10, factor=1.5, min_delta=0.1) is None
    )  # too little data
    assert entropy_spike([1.0] * 10 + [math.nan], window=10, factor=1.5, min_delta=0.1) is None
    run = healthy()
    run[40]["policy/entropy"] = 3.0
    hits = scan(run, CFG)
    assert [(w.kind, w.step) for w in hits] == [(GuardKind.ENTROPY_SPIKE, 41)]
    assert "entropy spiked to 3" in hits[0].message


def test_logprob_diff_drift() -> None:
    assert logprob_diff_drift([0.01] * 5, [0.03] * 5, factor=2.0, min_abs=0.005) == (0.03, 0.02)
    assert logprob_diff_drift([0.01] * 5, [0.015] * 5, factor=2.0, min_abs=0.005) is None
    assert logprob_diff_drift([0.001] * 5, [0.003] * 5, factor=2.0, min_abs=0.005) is None
    run = healthy()
    for r in run[30:]:
        r["mismatch/train_rollout_logprob_abs_diff"] = 0.05
    hits = [w for w in scan(run, CFG) if w.kind is GuardKind.LOGPROB_DIFF_DRIFT]
    assert hits and hits[0].step in range(31, 35)  # fires within the averaging window
    assert all(w.step >= 31 for w in hits)


def test_is_weight_range_per_source() -> None:
    assert is_weight_out_of_range(1.0, lower=0.8, upper=1.25) is None
    assert is_weight_out_of_range(0.5, lower=0.8, upper=1.25) == (0.5, 0.8)
    assert is_weight_out_of_range(1.6, lower=0.8, upper=1.25) == (1.6, 1.25)
    assert is_weight_out_of_range(None, lower=0.8, upper=1.25) is None
    run = healthy()
    run[20]["is/engine/mean"] = 1.9
    run[21]["is/staleness/mean"] = 0.3
    run[22]["is/drift/mean"] = 5.0  # drift is not a watched source by default
    hits = scan(run, CFG)
    assert [(w.step, w.key) for w in hits] == [(21, "is/engine/mean"), (22, "is/staleness/mean")]
    assert "engine IS weight mean 1.9 left [0.8, 1.25]" in hits[0].message


def test_ess_and_gradient_cosine_floors() -> None:
    assert window_mean_below([0.9, 0.2, 0.3], window=2, floor=0.5) == (0.25, 0.5)
    assert window_mean_below([0.2, None, 0.3], window=3, floor=0.5) is None  # too few values
    assert window_mean_below([0.6, 0.7], window=2, floor=0.5) is None
    run = healthy()
    for k in range(30, 40):  # the weights concentrate, then the updates turn against each other
        run[k]["is/staleness/ess"] = 0.2
    for k in range(35, 45):
        run[k]["train/grad_cosine"] = -0.6
    cfg = dataclasses.replace(CFG, ess_window=3, ess_floor=0.5, grad_cosine_window=3)
    hits = scan(run, cfg)
    kinds = [(w.kind, w.step) for w in hits]
    assert kinds[0] == (GuardKind.IS_ESS_LOW, 32)  # 2 of 3 steps low: the mean is 0.45
    first_cos = next(s for k, s in kinds if k is GuardKind.GRAD_COSINE_LOW)
    assert first_cos == 37
    assert "effective sample size" in hits[0].message


def test_rollout_logprob_trend() -> None:
    down = [-1.0 - 0.02 * i for i in range(20)]
    drop, thr = trend_drop(down, window=20, min_drop=0.15)
    assert drop == pytest.approx(0.38) and thr == 0.15
    assert trend_drop(down[::-1], window=20, min_drop=0.15) is None  # rising
    assert trend_drop(down[:10], window=20, min_drop=0.15) is None  # not enough steps
    run = healthy()
    for i, r in enumerate(run[30:]):
        r["rollout/logprob_mean"] = -0.9 - 0.03 * i
    hits = [w for w in scan(run, CFG) if w.kind is GuardKind.ROLLOUT_LOGPROB_TREND]
    assert hits and 38 <= hits[0].step <= 50


def test_monitor_reports_onset_then_repeats_sparsely() -> None:
    mon = GuardMonitor(CFG, repeat_every=10)
    run = healthy(80)
    for r in run[30:]:
        r["is/combined/mean"] = 2.0
    shown = [w.step for r in run for w in mon.update(r)]
    assert shown == [31, 41, 51, 61, 71]
    # a healthy gap, then a new onset is reported at once
    mon2 = GuardMonitor(CFG, repeat_every=100)
    run2 = healthy(40)
    for k in (10, 11, 30):
        run2[k]["is/combined/mean"] = 2.0
    assert [w.step for r in run2 for w in mon2.update(r)] == [11, 31]


def test_monitor_matches_scan_with_bounded_memory() -> None:
    run = healthy(200)
    for r in run[120:]:
        r["mismatch/train_rollout_logprob_abs_diff"] = 0.08
    mon = GuardMonitor(CFG, repeat_every=1)
    live = [(w.kind, w.step) for r in run for w in mon.update(r)]
    assert live == [(w.kind, w.step) for w in scan(run, CFG)] != []
    assert len(mon.history) <= max(CFG.entropy_window + 1, CFG.trend_window, CFG.diff_window)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="is_lower < 1 < is_upper"):
        GuardConfig(is_lower=1.1)
    with pytest.raises(ValueError, match="trend_window"):
        GuardConfig(trend_window=2)


def test_a_one_step_blip_is_not_reported_but_a_persistent_spike_is():
    cfg = GuardConfig()  # persist_steps=3
    blip = [{"step": k, "policy/entropy": 3.0 if k == 12 else 1.0} for k in range(1, 20)]
    assert scan(blip, cfg) == []
    spike = [{"step": k, "policy/entropy": 3.0 if 12 <= k <= 14 else 1.0} for k in range(1, 20)]
    assert [(w.kind, w.step) for w in scan(spike, cfg)] == [(GuardKind.ENTROPY_SPIKE, 14)]
    mon = GuardMonitor(cfg)
    fired = [w.step for rec in spike for w in mon.update(rec)]
    assert fired == [14]


def test_the_gap_baseline_waits_for_the_staleness_budget_to_fill() -> None:
    """An async run's gap rises while stale samples start arriving (here steps 1-20), then
    stays flat: staleness arriving, not drift. Taken from the first steps the baseline makes the
    drift guard fire on such a run; taken after the fill it stays quiet, and a real rise later
    still fires, live and in the replay alike."""
    key = "mismatch/train_rollout_logprob_abs_diff"
    run = healthy(120)
    for r in run:
        r[key] = 0.002 + 0.048 * min(r["step"], 20) / 20  # 0.0044 ... 0.05, then flat
    fired = [w for w in scan(run, CFG) if w.kind is GuardKind.LOGPROB_DIFF_DRIFT]
    assert fired  # the on-policy start as the baseline
    after_fill = dataclasses.replace(CFG, diff_baseline_skip=20)
    assert [w for w in scan(run, after_fill) if w.kind is GuardKind.LOGPROB_DIFF_DRIFT] == []
    for r in run[80:]:
        r[key] = 0.25  # drift: 5x the filled level
    hits = [w for w in scan(run, after_fill) if w.kind is GuardKind.LOGPROB_DIFF_DRIFT]
    assert hits and min(w.step for w in hits) > 80
    mon = GuardMonitor(after_fill, repeat_every=1)
    live = [(w.kind, w.step) for r in run for w in mon.update(r)]
    assert live == [(w.kind, w.step) for w in scan(run, after_fill)]


def test_staleness_fill_steps_is_the_staleness_bound() -> None:
    dw = DataWorkerConfig(max_staleness=16, fifo_window=4, groups_per_step=2)
    assert staleness_fill_steps(dw) == 16 + 2  # S + ceil((W - 1) / B)
    assert staleness_fill_steps(dataclasses.replace(dw, max_off_policy_steps=5)) == 5
    unbounded = dataclasses.replace(dw, fifo_window=math.inf)
    assert staleness_fill_steps(unbounded) == 17  # unbounded: S + 1
    assert staleness_fill_steps(dataclasses.replace(dw, max_staleness=0, fifo_window=1)) == 0
    with pytest.raises(ValueError, match="diff_baseline_skip"):
        GuardConfig(diff_baseline_skip=-1)


def test_a_saved_config_reads_back_with_the_dataclass_defaults() -> None:
    """A run dir's config.json `data_worker` section (what the report reads): its values, the
    window as JSON or text; a key an older file lacks takes the `DataWorkerConfig` default, and
    a key no field has is ignored."""
    saved = {"max_staleness": 16, "fifo_window": 4, "groups_per_step": 2, "gone_field": 1}
    dw = data_worker_config_from_record(saved)
    assert (dw.max_staleness, dw.fifo_window, dw.groups_per_step) == (16, 4, 2)
    assert dw.max_off_policy_steps is None and dw.max_inflight == DataWorkerConfig().max_inflight
    assert staleness_fill_steps(dw) == 18
    for inf in ("inf", math.inf):
        assert data_worker_config_from_record({**saved, "fifo_window": inf}).fifo_window == math.inf
    old = data_worker_config_from_record({"max_staleness": 3})
    assert old.groups_per_step == DataWorkerConfig().groups_per_step
    assert old.fifo_window == 2 * old.groups_per_step
    assert run_guard_config(old) == run_guard_config(DataWorkerConfig(max_staleness=3))
    assert saved_run_guard_config({"data_worker": saved}) == run_guard_config(dw)
    assert saved_run_guard_config({"num_steps": 3}) == GuardConfig()  # none saved: no skip


def test_a_run_takes_its_gap_baseline_once_the_staleness_settled() -> None:
    """As the lab's runs do: the staleness climbs to S, the queue drains (staleness 0 again),
    and only the refill settles near S, between one and two bounds in; the gap grows with the
    lag (`s4-ppo-rron-n4-seed1`: median 0.009 one bound in, 0.02-0.03 settled). A baseline one
    bound in falls in the refill and reads the settled gap as drift; the run's, two bounds in,
    stays quiet on it and still fires on a real rise."""
    key = "mismatch/train_rollout_logprob_abs_diff"
    dw = DataWorkerConfig(max_staleness=8, fifo_window=4, groups_per_step=2)
    bound = staleness_fill_steps(dw)
    cfg = run_guard_config(dw)
    assert bound == 10 and cfg.diff_baseline_skip == BASELINE_AFTER_BOUNDS * bound == 20
    run = healthy(150)
    for r in run:
        k = r["step"]
        lag = k - 1 if k <= 9 else (k - 10 if k <= 18 else 8)  # 0..8, drained, 0..8, settled
        r[key] = 0.003 + 0.0006 * lag**2
    one_bound = dataclasses.replace(cfg, diff_baseline_skip=bound)
    assert [w for w in scan(run, one_bound) if w.kind is GuardKind.LOGPROB_DIFF_DRIFT]
    assert [w for w in scan(run, cfg) if w.kind is GuardKind.LOGPROB_DIFF_DRIFT] == []
    for r in run[100:]:
        r[key] = 0.2  # 5x the settled gap
    hits = [w for w in scan(run, cfg) if w.kind is GuardKind.LOGPROB_DIFF_DRIFT]
    assert hits and min(w.step for w in hits) > 100


def test_the_calibrated_defaults_stay_quiet_on_a_healthy_run_and_fire_on_a_drift() -> None:
    """The defaults (docs/stability.md#divergence-guards) with their persistence: nothing on
    noisy healthy runs; a gap that triples after a flat start, and a log-prob that falls
    steadily, are reported."""
    cfg = GuardConfig()
    for seed in range(5):
        assert scan(healthy(120, seed=seed), cfg) == []
    run = healthy(120)
    for i, r in enumerate(run[60:]):
        r["mismatch/train_rollout_logprob_abs_diff"] = 0.05
        r["rollout/logprob_mean"] = -0.8 - 0.02 * i
    kinds = {w.kind for w in scan(run, cfg)}
    assert {GuardKind.LOGPROB_DIFF_DRIFT, GuardKind.ROLLOUT_LOGPROB_TREND} <= kinds
