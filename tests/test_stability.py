"""Stability lab: the verdict rules on synthetic curves, the grid's plumbing (names, flags the
real parser accepts, the report from runs logged through the real MetricsLogger), the eval's
standard error, and (slow) a two-cell few-step grid of real train_async.py runs end to end."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import analysis as lab
from lab import report as lab_report
from lab.goals import Goals
from slime_async.config import parse_config
from slime_async.metrics import GuardKind, MetricsLogger
from slime_async.metrics.stability import (
    GAP_KEY,
    REWARD_KEY,
    Verdict,
    VerdictRules,
    cell_verdict,
    guard_hits,
    mean_and_se,
    mean_ci,
    summarize,
    verdict,
    windows,
)
from slime_async.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]
_PATH = ROOT / "scripts" / "bench_stability.py"
RULES = VerdictRules()


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_stability", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_stability"] = mod
    spec.loader.exec_module(mod)
    return mod


def curves(n=100, *, gap=lambda t: 0.01, reward=lambda t: 0.5, seed=0, noise=0.01):
    """Records of a synthetic run: gap(t) and reward(t) for t in [0, 1), with noise."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        t = k / n
        out.append(
            {
                "step": k + 1,
                GAP_KEY: gap(t) * (1 + rng.gauss(0, noise)),
                REWARD_KEY: reward(t) + rng.gauss(0, noise),
                "train/grad_norm": 0.5,
                "loss/total": 0.1,
            }
        )
    return out


def judge(records):
    return verdict(summarize(records, RULES), RULES)[0]


# ------------------------------------------------------------------------- verdict rules
def test_flat_gap_and_rising_reward_is_stable() -> None:
    recs = curves(reward=lambda t: 0.4 + 0.3 * t)
    s = summarize(recs, RULES)
    assert abs(s.gap_ratio - 1.0) < 0.05 and s.reward_fall < 0.02
    v, why = verdict(s, RULES)
    assert v is Verdict.STABLE and "(flat)" in why


def test_gap_doubling_is_drifting_and_fivefold_is_collapsed() -> None:
    def step_up(factor):  # flat, then `factor` x from half-way
        return lambda t: 0.01 if t < 0.5 else 0.01 * factor

    assert judge(curves(gap=step_up(2.5))) is Verdict.DRIFTING
    assert judge(curves(gap=step_up(6.0))) is Verdict.COLLAPSED
    v, why = verdict(summarize(curves(gap=step_up(1.6)), RULES), RULES)
    assert v is Verdict.STABLE and "not flat" in why  # grew, but under the drift bar


def test_reward_falling_from_its_peak_drifts_then_collapses() -> None:
    def rise_fall(drop):
        return lambda t: 0.3 + 0.4 * min(t, 0.5) * 2 - drop * max(0.0, t - 0.5) * 2

    assert judge(curves(reward=rise_fall(0.0))) is Verdict.STABLE
    assert judge(curves(reward=rise_fall(0.18))) is Verdict.DRIFTING
    assert judge(curves(reward=rise_fall(0.45))) is Verdict.COLLAPSED


def test_a_run_without_the_gap_metric_is_judged_on_reward_alone() -> None:
    recs = [{k: v for k, v in r.items() if k != GAP_KEY} for r in curves()]
    v, why = verdict(summarize(recs, RULES), RULES)
    assert v is Verdict.STABLE and why.startswith("no log-prob gap logged")


def test_a_non_finite_gradient_norm_is_collapsed() -> None:
    recs = curves()
    recs[50]["train/grad_norm"] = float("nan")
    v, why = verdict(summarize(recs, RULES), RULES)
    assert v is Verdict.COLLAPSED and "non-finite" in why


def test_the_start_window_skips_the_staleness_fill() -> None:
    # gap is small for the first 10% of steps (budget filling), then flat: not drift
    recs = curves(gap=lambda t: 0.002 if t < 0.1 else 0.01)
    assert judge(recs) is Verdict.STABLE
    assert summarize(recs, RULES).gap_ratio == pytest.approx(1.0, abs=0.05)
    # judged from step 0, the same curve would read as a growth
    assert summarize(recs, VerdictRules(skip_frac=0.0)).gap_ratio > 1.6


def test_a_long_staleness_fill_is_skipped_by_the_runs_bound() -> None:
    """At S = 64 the budget fills over the first third of a 200-step run: the gap rises 4x
    while staler samples arrive, then stays flat. With the run's bound as `fill_steps` the
    start window begins after the fill (stable); a gap that keeps rising after it still
    drifts."""
    fill = 66
    recs = curves(200, gap=lambda t: 0.02 + 0.06 * min(t * 200, fill) / fill)
    assert summarize(recs, RULES).gap_ratio > 1.3  # the 10% skip alone reads the fill as growth
    s = summarize(recs, RULES, fill_steps=fill)
    assert s.gap_ratio == pytest.approx(1.0, abs=0.05)
    assert verdict(s, RULES)[0] is Verdict.STABLE
    rising = curves(200, gap=lambda t: 0.02 + 0.06 * min(t * 200, fill) / fill + 0.4 * t * t)
    assert verdict(summarize(rising, RULES, fill_steps=fill), RULES)[0] is not Verdict.STABLE


def test_windows_on_an_exact_series() -> None:
    xs = list(range(10))  # window 3 (min_window), skip 1: start = mean(1,2,3), end = mean(7,8,9)
    start, peak, end = windows(xs, VerdictRules())
    assert (start, peak, end) == (2.0, 8.0, 8.0)
    assert all(math.isnan(v) for v in windows([1.0, 2.0], VerdictRules()))


def test_cell_verdict_is_the_median_with_counts() -> None:
    s, d, c = Verdict.STABLE, Verdict.DRIFTING, Verdict.COLLAPSED
    assert cell_verdict([s, s, c]) == (s, "2 stable, 1 collapsed")
    assert cell_verdict([s, d, c])[0] is d
    assert cell_verdict([s, d])[0] is d  # ties go to the worse
    with pytest.raises(ValueError, match="at least one run"):
        cell_verdict([])


def test_rules_refuse_inconsistent_thresholds() -> None:
    with pytest.raises(ValueError, match="flat_gap_ratio"):
        VerdictRules(drift_gap_ratio=1.1)
    with pytest.raises(ValueError, match="window_frac"):
        VerdictRules(window_frac=0.9)


def test_mean_se_and_t_interval_on_known_vectors() -> None:
    m, se = mean_and_se([0, 1, 1, 0])
    assert m == 0.5 and se == pytest.approx(math.sqrt((1 / 3) / 4))
    assert mean_and_se([0.7]) == (0.7, 0.0)
    m, h = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(mean_ci([1.0])[1]) and math.isnan(mean_ci([])[0])


def test_guard_hits_sees_a_doubling_gap() -> None:
    assert GuardKind.LOGPROB_DIFF_DRIFT in guard_hits(curves(gap=lambda t: 0.01 * (1 + 4 * t)))
    assert GuardKind.LOGPROB_DIFF_DRIFT not in guard_hits(curves())


def test_eval_samples_per_prompt_is_validated() -> None:
    with pytest.raises(ValueError, match="--n-samples-per-eval-prompt must be >= 1, got 0"):
        RolloutConfig(n_samples_per_eval_prompt=0)


# ------------------------------------------------------------------------- grid plumbing
def test_grid_names_filter_and_flags_parse(bench, tmp_path) -> None:
    cells = lab.grid((0, 16), ("ppo", "tis", "compis"), ("on", "off"), (1, 4), (1, 2, 3))
    assert len(cells) == 2 * 3 * 2 * 2 * 3
    assert len({c.name for c in cells}) == len(cells)
    picked = lab.select(cells, "s16-compis-*-n4-*,s0-ppo-rron-n1-seed1")
    assert {c.name for c in picked} == {
        *(f"s16-compis-rr{r}-n4-seed{s}" for r in ("on", "off") for s in (1, 2, 3)),
        "s0-ppo-rron-n1-seed1",
    }
    with pytest.raises(ValueError, match="unknown loss 'bogus'"):
        lab.grid((0,), ("bogus",), ("on",), (1,), (1,))
    budget = lab.Budget(
        num_rollout=5, eval_interval=5, eval_prompts=172, eval_samples=4, warmstart_steps=None
    )
    for cell in lab.grid((0, 16), tuple(lab.LOSSES), ("on", "off"), (1, 4), (1,)):
        cfg = parse_config(lab.train_args(cell, budget, tmp_path / cell.name, None))
        assert cfg.data_worker.max_staleness == cell.staleness
        assert cfg.rollout.num_steps_per_rollout == cell.nspr
        assert cfg.trainer.routing_replay.value == ("r3" if cell.replay else "none")
        assert cfg.rollout.n_samples_per_eval_prompt == 4
        if cell.loss == "compis":  # the method with its true pi_j, not the fallback
            assert cfg.trainer.keep_old_actor
        # equal sample budget: every cell trains num_rollout x the same rollout
        assert cfg.num_steps * cfg.rollout.global_batch_size == 5 * 64


def _fake_run(bench, out: Path, cell, *, steps: int, gap, seed: int) -> None:
    """A finished run directory whose metrics went through the real MetricsLogger."""
    d = out / "runs" / cell.name
    rng = random.Random(seed)
    with MetricsLogger(d, console=False, progress=False, stderr=io.StringIO()) as ml:
        for k in range(1, steps + 1):
            t = k / steps
            m = {
                GAP_KEY: gap(t) * (1 + rng.gauss(0, 0.02)),
                REWARD_KEY: 0.4 + 0.2 * t + rng.gauss(0, 0.02),
                "policy/entropy": 0.5,
                "is/staleness/p99": 1.1,
                "is/engine/p99": 1.02,
                "is/drift/p99": 1.05,
                "train/grad_norm": 0.3,
                "staleness/mean": float(cell.staleness),
            }
            ml.log(k, m)
            if k % 5 == 0:
                ml.log(k, {"eval/reward": 0.3 + 0.2 * t, "eval/reward_se": 0.018})
    ro = {
        "global_batch_size": 16,
        "num_steps_per_rollout": 4,
        "eval_interval": 5,
        "eval_prompts": 172,
        "n_samples_per_eval_prompt": 4,
    }
    (d / "config.json").write_text(json.dumps({"num_steps": steps, "rollout": ro}))
    budget = lab.Budget(
        num_rollout=steps // 4,
        eval_interval=5,
        eval_prompts=172,
        eval_samples=4,
        warmstart_steps=None,
    )
    (d / lab.RESULT).write_text(
        json.dumps({"status": "ok", "wall_s": 1.0, "budget": lab.budget_record(budget)})
    )


def test_report_from_logged_runs_has_figure_table_verdicts_and_guards(bench, tmp_path) -> None:
    cells = lab.grid((0, 16), ("ppo", "compis"), ("on",), (4,), (1, 2))
    for i, c in enumerate(cells):
        drift = c.staleness == 16 and c.loss == "ppo"
        _fake_run(
            bench,
            tmp_path,
            c,
            steps=40,
            seed=i,
            gap=(lambda t: 0.01 * (1 + 10 * t)) if drift else (lambda t: 0.01),
        )
    argv = [
        "--out",
        str(tmp_path),
        "--staleness",
        "0,16",
        "--losses",
        "ppo,compis",
        "--replay",
        "on",
        "--nspr",
        "4",
        "--seeds",
        "1,2",
        "--num-rollout",
        "10",
        "--eval-interval",
        "5",
        "--report-only",
    ]
    assert bench.main(argv) == 0
    png = (tmp_path / "stability.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    md = (tmp_path / "stability.md").read_text()
    assert "10 rollouts = 640 samples; eval every 5 rollouts on 172 prompts × 4 samples" in md
    assert "| `s16-ppo-rron-n4` | 2 | drifting (2 drifting) |" in md
    assert "| `s16-compis-rron-n4` | 2 | stable (2 stable) |" in md
    assert "uncorrected PPO drifts (gap end/start ≥ 2 or reward falling): yes" in md
    assert "CompIS flat (gap end/start ≤ 1.2): yes" in md
    assert "| `s16-compis-rron-n4` | sync, same loss | 2 | 0.000 ± 0.000 |" in md  # paired
    assert "final eval within 0.05 of sync `s0-compis-rron-n4`: yes" in md
    summary = json.loads((tmp_path / "summary.json").read_text())
    sweep = summary["guards"]["sweep"][str(GuardKind.LOGPROB_DIFF_DRIFT)]["rows"]
    default = next(r for r in sweep if r["default"])
    assert (default["unstable_hits"], default["stable_hits"]) == (2, 0)
    assert summary["cells"]["s0-compis-rron-n4"]["eval_final"][0] == pytest.approx(0.5)
    # pooled async - sync: the drifting ppo's end gap is far above sync's, CompIS's is not
    pooled = summary["vs_sync"]
    assert pooled["ppo"]["s16"]["gap_end"][2] == 2 and pooled["ppo"]["s16"]["gap_end"][0] > 0.04
    assert abs(pooled["compis"]["s16"]["gap_end"][0]) < 0.005
    assert "| train–rollout gap at the end | s16 |" in md


def test_replay_effect_pools_seed_paired_runs_as_a_geometric_mean(bench) -> None:
    per_run = {}
    for s, ratio in ((0, 0.5), (16, 0.8)):  # R3 on / off gap ratio per staleness
        for seed, off in ((1, 0.01), (2, 0.02), (3, 0.04)):
            for rr, gap in (("rroff", off), ("rron", off * ratio)):
                g = f"s{s}-compis-{rr}-n4"
                per_run[f"{g}-seed{seed}"] = {"group": g, "gap_end": gap, "engine_gap": math.nan}
    per_run["s16-ppo-rroff-n4-seed9"] = {
        "group": "s16-ppo-rroff-n4",
        "gap_end": 1.0,
        "engine_gap": 1.0,
    }  # no R3-on partner: left out
    eff = lab.replay_effect(per_run)
    gm = math.sqrt(0.5 * 0.8) - 1  # three pairs at each ratio
    m, lo, hi, k = eff["gap_end"]["all"]
    assert k == 6 and m == pytest.approx(gm) and lo < m < hi
    assert eff["gap_end"]["s0"] == pytest.approx([-0.5, -0.5, -0.5, 3])  # no spread: exact
    assert eff["gap_end"]["s16"][0] == pytest.approx(-0.2)
    assert eff["engine_gap"]["all"][3] == 0  # NaN gaps are not pairs
    lines = "\n".join(lab_report.goal_checks({"cells": {}, "replay": eff}))
    assert "pooled over 6 seed-paired run pairs, train–rollout gap" in lines
    assert "engine gap" not in lines
    # the bar is `Goals.replay_change` (Relax's −38%): [−52%, −17%] straddles it; −10% is met
    assert "−38% or better: not resolved" in lines
    looser = "\n".join(
        lab_report.goal_checks({"cells": {}, "replay": eff}, Goals(replay_change=-0.1))
    )
    assert "−10% or better: yes" in looser


def test_a_stalled_run_is_killed_with_its_children_a_moving_one_is_not(bench, tmp_path) -> None:
    pidfile, metrics = tmp_path / "child.pid", tmp_path / "metrics.jsonl"
    stalls = ["bash", "-c", f"echo started; sleep 300 & echo $! > {pidfile}; wait"]
    t0 = time.monotonic()
    with (tmp_path / "train.log").open("w") as log:
        rc = bench.run_logged(stalls, log, env=dict(os.environ), progress=(metrics,), stall_s=3.0)
    assert rc == bench.TIMED_OUT and time.monotonic() - t0 < 60
    text = (tmp_path / "train.log").read_text()
    assert text.startswith("started\n")  # the run's own output is kept
    assert "killed: no progress for --stall-timeout 3s" in text
    child = int(pidfile.read_text())
    for _ in range(200):  # killed: gone, or a zombie where PID 1 does not reap orphans
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the run's child {child} outlived the stall")
    # a run that logs a step every second runs 8 s, well past a 3 s stall window
    moves = ["bash", "-c", f"for i in 1 2 3 4 5 6 7 8; do echo $i >> {metrics}; sleep 1; done"]
    with (tmp_path / "ok.log").open("w") as log:
        rc = bench.run_logged(moves, log, env=dict(os.environ), progress=(metrics,), stall_s=3.0)
    assert rc == 0 and metrics.read_text().split() == [str(i) for i in range(1, 9)]


def test_a_run_of_another_budget_is_refused_not_rerun_or_mixed(bench, tmp_path, capsys) -> None:
    cells = lab.grid((0,), ("ppo",), ("on",), (4,), (1,))
    _fake_run(bench, tmp_path, cells[0], steps=40, gap=lambda t: 0.01, seed=0)  # 10 rollouts
    before = (tmp_path / "runs" / cells[0].name / "metrics.jsonl").read_bytes()
    base = [
        "--out",
        str(tmp_path),
        "--staleness",
        "0",
        "--losses",
        "ppo",
        "--replay",
        "on",
        "--nspr",
        "4",
        "--seeds",
        "1",
        "--eval-interval",
        "5",
    ]
    # asked for 20 rollouts: neither a run nor a report over the 10-rollout run
    for extra in (
        ["--num-rollout", "20"],
        ["--num-rollout", "20", "--report-only"],
        ["--num-rollout", "10", "--report-only", "--", "--lr", "1e-3"],
    ):
        assert bench.main(base + extra) == 2
        err = capsys.readouterr().err
        assert "finished with budget" in err and "give another --out" in err
    assert (tmp_path / "runs" / cells[0].name / "metrics.jsonl").read_bytes() == before
    assert bench.main([*base, "--num-rollout", "10", "--report-only"]) == 0  # its own budget


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_cell_grid_runs_end_to_end_and_resumes(tmp_path) -> None:
    """Two real train_async.py runs (sync and staleness 4, CompIS), a few steps each."""
    cmd = [
        sys.executable,
        str(_PATH),
        "--out",
        str(tmp_path),
        "--staleness",
        "0,4",
        "--losses",
        "compis",
        "--replay",
        "on",
        "--nspr",
        "1",
        "--seeds",
        "1",
        "--num-rollout",
        "3",
        "--eval-interval",
        "3",
        "--eval-prompts",
        "8",
        "--eval-samples",
        "2",
        "--warmstart-steps",
        "10",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 of 2 runs already done" in done.stdout
    assert (tmp_path / "stability.png").stat().st_size > 10_000
    md = (tmp_path / "stability.md").read_text()
    assert "| `s0-compis-rron-n1` | 1 |" in md and "| `s4-compis-rron-n1` | 1 |" in md
    for name in ("s0-compis-rron-n1-seed1", "s4-compis-rron-n1-seed1"):
        log = (tmp_path / "runs" / name / "train.log").read_text()
        assert "warm start: reusing" in log  # the per-seed warm start was shared, not retrained
        recs = [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").open()]
        assert any("eval/reward_se" in r for r in recs)
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and "2 of 2 runs already done; 0 to run" in again.stdout


def test_guard_calibration_picks_the_quietest_of_the_settings_within_one_unstable_run() -> None:
    """9 unstable and 270 stable runs (a third: 90). The best separation among the settings
    under the false-alarm cap is `loud` (+0.45); `quiet` is within one unstable run of it
    (+0.40 >= 0.45 - 1/9) and fires on far fewer healthy runs, so it is picked; `silent` is
    quieter still but two unstable runs worse, and `over` breaks the cap."""
    rows = [("over", 9, 100), ("loud", 7, 89), ("quiet", 4, 12), ("silent", 2, 0)]
    assert lab.choose_setting(rows, 9, 270) == ("quiet", 4, 12)
    assert lab.choose_setting([("loud", 7, 89), ("silent", 2, 0)], 9, 270)[0] == "loud"
    assert lab.choose_setting([("over", 9, 100)], 9, 270) is None


def test_protocol_rules_pick_the_regime_and_test_equivalence():
    import dataclasses

    from lab.protocol import RegimeOutcome, choose_regime, confirm_cells, paired_diffs, tost

    o = [
        RegimeOutcome(regime="a", sync_stable=True, none_minus_sync=-0.01, none_unstable=False),
        RegimeOutcome(regime="b", sync_stable=True, none_minus_sync=-0.06, none_unstable=False),
        RegimeOutcome(regime="c", sync_stable=True, none_minus_sync=-0.2, none_unstable=True),
    ]
    assert choose_regime(o) == ("b", True)
    assert choose_regime(o[:1]) == ("a", False)
    o[1] = dataclasses.replace(o[1], sync_stable=False)  # not eligible: skipped
    assert choose_regime(o) == ("c", True)
    with pytest.raises(ValueError, match="no search regime"):
        choose_regime([dataclasses.replace(o[1], regime="x")])
    t = tost([0.01, -0.01, 0.02, 0.0, 0.01])  # mean 0.006, sd 0.0114: t(4) = 2.132
    assert t.mean == pytest.approx(0.006) and t.high == pytest.approx(
        0.006 + 2.132 * 0.011402 / 5**0.5, abs=1e-5
    )
    assert t.equivalent
    assert not tost([0.1, -0.1, 0.08, -0.09]).equivalent  # too noisy to show it
    assert not tost([-0.06, -0.07, -0.065]).equivalent
    seeds, d = paired_diffs(
        {"a-seed1": 0.5, "a-seed2": 0.4, "b-seed1": 0.3, "b-seed3": 0.1}, "a", "b"
    )
    assert seeds == [1] and d == [pytest.approx(0.2)]
    cells = confirm_cells()
    assert len({c.name for c in cells}) == len(cells) == 30 + 3 * 10 + 6
    assert [c.group for c in cells[:3]] == ["s0-ppo-rron-n1", "s8-ppo-rron-n1", "s8-compis-rron-n1"]


def test_protocol_report_reads_the_search_leads_and_equivalence():
    from lab.analysis import Cell, RunData
    from lab.protocol_report import (
        early_warning,
        equivalence_rows,
        onset_step,
        regime_outcome,
        render_protocol,
        speedups,
    )

    def run(group_cell: Cell, records, wall=10.0):
        return RunData(cell=group_cell, records=records, gbs=64, wall_s=wall)

    def pr(group, seed, verdict_, final, wall=10.0):
        return {
            f"{group}-seed{seed}": {
                "group": group,
                "verdict": verdict_,
                "eval_final": final,
                "wall_s": wall,
            }
        }

    search = {
        **pr("s0-ppo-rron-n1", 1, "stable", 0.40),
        **pr("s0-ppo-rron-n1", 2, "stable", 0.30),
        **pr("s8-ppo-rron-n1", 1, "stable", 0.33),
        **pr("s8-ppo-rron-n1", 2, "stable", 0.26),
    }
    o = regime_outcome("lr4e-4", search)
    assert o.sync_stable and o.none_minus_sync == pytest.approx(-0.055) and o.breaks
    unlearned = {n: {**r, "eval_first": r["eval_final"] + 0.04} for n, r in search.items()}
    assert regime_outcome("x", unlearned).sync_stable  # 0.04 below the baseline: within 0.05
    unlearned["s0-ppo-rron-n1-seed2"]["eval_first"] = 0.36  # 0.36 → 0.30: unlearned
    assert not regime_outcome("x", unlearned).sync_stable

    # a run whose reward falls in its second half: unstable from some step on; its ESS
    # collapses ten steps before the reward starts to fall
    falling = curves(60, reward=lambda t: 0.6 if t < 0.5 else 0.6 - 0.8 * (t - 0.5), seed=1)
    for k, rec in enumerate(falling):
        rec["is/staleness/ess"] = 0.9 if k < 20 else 0.2
    flat = curves(60, seed=2)
    for rec in flat:
        rec["is/staleness/ess"] = 0.9
    bad = run(Cell(staleness=8, loss="ppo", replay=True, nspr=1, seed=1), falling)
    sync = run(Cell(staleness=0, loss="ppo", replay=True, nspr=1, seed=1), flat)
    onset = onset_step(bad, RULES)
    assert onset is not None and 30 < onset <= 60 and onset_step(sync, RULES) is None
    ew = early_warning([("a", bad, "collapsed"), ("b", sync, "stable")], RULES)["is_ess_low"]
    assert ew["sync_runs"] == 1 and ew["sync_alarms"] == 0
    (u,) = ew["unstable"]
    # the 5-step mean is below the 0.7 floor from step 22 (2 low steps); reported after 3 in a row
    assert u["fired"] == 24 and u["lead"] == onset - 24
    dense_sync = run(Cell(staleness=0, loss="ppo", replay=False, nspr=1, seed=1), flat)
    ew = early_warning([("c", dense_sync, "stable")], RULES)["is_ess_low"]
    assert ew["sync_runs"] == 1 and ew["stable_async_runs"] == 0  # R3 off is still sync

    confirm = {}
    for seed, (s0, c8, n8) in enumerate([(0.4, 0.41, 0.30), (0.3, 0.29, 0.2), (0.5, 0.5, 0.41)]):
        confirm |= pr("s0-ppo-rron-n1", seed, "stable", s0, wall=30.0)
        confirm |= pr("s8-compis-rron-n1", seed, "stable", c8, wall=15.0)
        confirm |= pr("s8-ppo-rron-n1", seed, "stable", n8, wall=12.0)
    rows = {r["cell"]: r for r in equivalence_rows(confirm)}
    assert rows["s8-compis-rron-n1"]["equivalent"] and not rows["s8-ppo-rron-n1"]["equivalent"]
    assert rows["s1-tis-rron-n1"]["n"] == 0
    assert speedups(confirm) == [(0, 2.0), (1, 2.0), (2, 2.0)]
    md = render_protocol(
        outcomes=[o],
        choice=("lr4e-4", True),
        search_runs={"lr4e-4": search},
        confirm_per_run=confirm,
        confirm_runs=[],
        planned=66,
        judged=[],
        rules=RULES,
    )
    assert "Confirmatory regime: **lr4e-4**" in md and "| `s8-compis-rron-n1` | 3 |" in md
    assert "compis S = 8 wall: median 2.00×" in md and "none S = 8 wall: median 2.50×" in md
    assert "0 of 66 planned runs finished" in md


def test_phase3_picks_its_staleness_and_every_run_validates_with_the_recipe(bench, tmp_path):
    """Phase 3 (amendment 2): the staleness where workload T's arms span most (ties to the
    larger, 8 when none spans 0.05), its 21 runs in the protocol's order, each command line
    the real parser accepts with the shipped SmolLM2 recipe, meaning what its arm says."""
    pytest.importorskip("reasoning_gym")
    from lab.protocol import WORKLOAD_S, phase3_cells, phase3_staleness
    from slime_async.config import Environment, build_parser, validate
    from slime_async.config.recipe import apply_config_file
    from slime_async.contracts.model import ModelSpec

    means = {"s1-ppo-rron-n1": 0.30, "s1-compis-rron-n1": 0.32, "s4-ppo-rron-n1": 0.20}
    means |= {"s4-compis-rron-n1": 0.31, "s4-is-rron-n1": 0.27, "s8-ppo-rron-n1": 0.24}
    means |= {"s8-compis-rron-n1": 0.33, "s0-ppo-rron-n1": 0.0}  # sync is not an async arm
    assert phase3_staleness(means) == 4  # spans: S1 0.02, S4 0.11, S8 0.09
    assert phase3_staleness({**means, "s8-tis-rron-n1": 0.22}) == 8  # S8 0.11: the tie → 8
    assert phase3_staleness({k: 0.3 for k in means}) == 8  # nothing differs
    assert phase3_staleness({"s1-ppo-rron-n1": 0.1}) == 8  # one arm has no span
    cells = phase3_cells(4)
    assert len({c.name for c in cells}) == len(cells) == 5 * 3 + 3 * 2
    assert [c.group for c in cells[:3]] == [
        "s0-ppo-rroff-n1",
        "s4-ppo-rroff-n1",
        "s4-compis-rroff-n1",
    ]
    assert {c.seed for c in cells if c.loss == "tis"} == {11, 12, 13} and not any(
        c.replay for c in cells
    )

    w = WORKLOAD_S
    budget = lab.Budget(
        num_rollout=w.steps,
        eval_interval=w.eval_interval,
        eval_prompts=w.eval_prompts,
        eval_samples=w.eval_samples,
        warmstart_steps=None,
        extra=w.flags,
    )
    env = Environment(model=ModelSpec(family="llama"), cpus=(0, 1), memory_bytes=24 * 1024**3)
    for c in cells[:3] + cells[-2:]:
        parser = build_parser()
        apply_config_file(parser, ROOT / w.recipe)
        cfg = validate(parser.parse_args(lab.train_args(c, budget, tmp_path / c.name, None)), env)
        assert cfg.data_worker.max_staleness == c.staleness and cfg.num_steps == w.steps
        assert cfg.trainer.keep_old_actor is (c.loss == "compis")
        assert cfg.trainer.loss.name == lab.LOSSES[c.loss][1] and cfg.trainer.save_hf is None
        assert cfg.trainer.routing_replay.value == "none"
        assert cfg.rollout.eval_interval == w.eval_interval and cfg.rollout.eval_prompts == 64
        assert (
            cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt == 32
        )  # the recipe's


def test_every_loss_of_the_grid_has_a_colour_in_the_figure():
    assert set(lab.LOSSES) <= set(lab_report.COLORS)  # the protocol's `is` arm had none


def test_phase3_report_compares_the_dense_arms_with_sync():
    from lab.protocol_report import render_phase3

    per_run = {}
    for seed, (s0, c4, n4) in enumerate([(0.4, 0.41, 0.30), (0.3, 0.29, 0.2), (0.5, 0.5, 0.41)]):
        for g, v, wall in (
            ("s0-ppo-rroff-n1", s0, 30.0),
            ("s4-compis-rroff-n1", c4, 15.0),
            ("s4-ppo-rroff-n1", n4, 20.0),
        ):
            per_run[f"{g}-seed{seed}"] = {
                "group": g,
                "verdict": "stable",
                "eval_final": v,
                "wall_s": wall,
            }
    md = render_phase3(staleness=4, per_run=per_run, runs=[], planned=21, rules=RULES)
    assert "Early warning over phase 3's runs, at each setting" in md
    assert "## Phase 3: workload S (SmolLM2-135M) at S = 4" in md and "0 of 21 planned" in md
    assert "| `s4-compis-rroff-n1` | 3 | -0.000 | [-0.017, +0.017] |" in md and "**yes**" in md
    assert "| `s4-ppo-rroff-n1` | 3 | -0.097 |" in md and "| `s4-tis-rroff-n1` | 0 |" in md
    assert "compis S = 4 wall: median 2.00×" in md and "none S = 4 wall: median 1.50×" in md
    assert "| `s4-ppo-rroff-n1-seed2` | stable | nan | 0.410 | 20 | — |" in md
    # the node's load beside each wall, and the speedups again over the quiet pairs only
    for n, r in per_run.items():
        r["load"] = 9.0 if n.endswith("seed1") else 3.0  # seed 1's runs shared the node
    per_run["s4-compis-rroff-n1-seed2"]["load"] = float("nan")  # not known: not quiet
    md = render_phase3(
        staleness=4, per_run=per_run, runs=[], planned=21, rules=RULES, quiet_load=5.0
    )
    assert "| `s4-ppo-rroff-n1-seed1` | stable | nan | 0.200 | 20 | 9.0 |" in md
    assert "| `s4-compis-rroff-n1-seed2` | stable | nan | 0.500 | 15 | — |" in md
    assert "compis S = 4 wall: median 2.00× over 3 seeds" in md
    assert "mean load ≤ 5: seed 0 2.00." in md  # seed 1 loaded, seed 2 unknown
    assert "mean load ≤ 5: seed 0 1.50, seed 2 1.50." in md


def test_a_runs_load_is_its_own_or_read_from_a_log_of_the_node():
    from lab.analysis import node_load, read_load_log

    records = [{"step": 0, "time": 100.0}, {"step": 1, "time": 160.0}]
    log = [(40.0, 30.0), (100.0, 2.0), (130.0, 4.0), (160.0, 6.0), (200.0, 50.0)]
    assert node_load(records, log) == pytest.approx(4.0)  # only the samples inside the run
    assert math.isnan(node_load(records, [(10.0, 1.0)])) and math.isnan(node_load(records))
    own = [{**r, "timing/node_load_1m": v} for r, v in zip(records, (1.0, 2.0))]
    assert node_load(own, log) == pytest.approx(1.5)  # what the run logged wins
    assert read_load_log(None) == []
