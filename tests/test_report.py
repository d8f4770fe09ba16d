"""Run report: PNG dashboard and guard verdict from a synthetic metrics.jsonl."""

from __future__ import annotations

import io
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from slime_async.metrics import MetricsLogger
from slime_async.metrics.report import main, render_overlay, render_report, run_labels


def synthetic_run(run_dir: Path, *, steps: int = 60, faults: bool = True, seed: int = 0) -> None:
    """Log a plausible async run through the real logger (optionally with planted faults)."""
    rng = random.Random(seed)
    with MetricsLogger(run_dir, console=False, progress=False, stderr=io.StringIO()) as ml:
        for k in range(1, steps + 1):
            reward = 0.3 + 0.4 * (1 - math.exp(-k / 25)) + rng.gauss(0, 0.04)
            m = {
                "rollout/reward": reward,
                "rollout/length": 6 + 2 * rng.random(),
                "rollout/logprob_mean": -0.8 + 0.004 * k + rng.gauss(0, 0.02),
                "policy/entropy": 0.9 - 0.004 * k + rng.gauss(0, 0.02),
                "loss/pg_loss": rng.gauss(0, 0.01),
                "mismatch/train_rollout_logprob_abs_diff": 0.012 + rng.gauss(0, 0.001),
                "staleness/mean": 1.2 + 0.2 * rng.random(),
                "staleness/max": float(rng.choice([1, 2, 2, 3])),
                "staleness/dropped": float(k // 20),
                "staleness/hist": [rng.randint(5, 10), rng.randint(10, 20), rng.randint(3, 8)],
                "timing/step_s": 2.0 + rng.random(),
                "timing/train_s": 1.2 + 0.3 * rng.random(),
                "timing/wait_batch_s": 0.3 * rng.random(),
                "timing/weight_sync_s": 0.2,
                "timing/elapsed_s": 2.5 * k,
                "idle/trainer_ratio": 0.1 + 0.05 * rng.random(),
                "idle/rollout_ratio": 0.05 + 0.05 * rng.random(),
            }
            for source, spread in (
                ("staleness", 0.3),
                ("engine", 0.05),
                ("drift", 0.02),
                ("combined", 0.35),
            ):
                mean = 1.0 + rng.gauss(0, 0.01)
                if faults and source == "engine" and 40 <= k <= 42:
                    mean = 1.6
                m |= {
                    f"is/{source}/mean": mean,
                    f"is/{source}/p50": 1.0 - spread / 10,
                    f"is/{source}/p90": 1 + spread,
                    f"is/{source}/p99": 1 + 2 * spread,
                    f"is/{source}/max": 1 + 4 * spread,
                    f"is/{source}/masked_frac": 0.001,
                    f"is/{source}/clipped_frac": spread / 10,
                }
            if faults and 30 <= k <= 32:
                m["policy/entropy"] = 2.5
            ml.log(k, m)
            if k % 10 == 0:
                ml.log(
                    k,
                    {
                        "eval/reward": reward - 0.05,
                        "eval/reward_level0": reward + 0.2,
                        "eval/reward_level3": reward - 0.3,
                    },
                )


def test_report_png_and_verdict_with_faults(tmp_path: Path) -> None:
    from PIL import Image

    synthetic_run(tmp_path)
    rep = render_report(tmp_path)
    assert rep.png == tmp_path / "report.png"
    with Image.open(rep.png) as im:
        assert im.format == "PNG" and im.size[0] > 1500 and im.size[1] > 1000
        assert len(set(im.convert("L").resize((64, 64)).getdata())) > 20  # not a blank canvas
    kinds = [(w.kind, w.key, w.step) for w in rep.warnings]
    # faults last three steps; a guard is reported once it persists (persist_steps=3)
    assert ("entropy_spike", "policy/entropy", 32) in kinds
    assert ("is_weight_range", "is/engine/mean", 42) in kinds
    assert "WARNING entropy_spike on policy/entropy: 1 step(s), first at step 32" in rep.verdict
    assert "WARNING is_weight_range on is/engine/mean" in rep.verdict
    assert "steps 1..60 (60 logged" in rep.verdict and "eval reward" in rep.verdict
    assert not list(tmp_path.glob(".report.png.tmp*"))


def test_healthy_run_verdict_is_ok(tmp_path: Path) -> None:
    synthetic_run(tmp_path, faults=False)
    rep = render_report(tmp_path, plot=False)
    assert rep.png is None and rep.warnings == []
    assert rep.verdict.endswith("guards: OK, no divergence signal fired")
    reward = rep.verdict.splitlines()[1]
    start, end = (float(x) for x in reward.split()[1:4:2])
    assert end > start + 0.2  # the synthetic reward rises


def test_sparse_log_still_renders(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, console=False, progress=False) as ml:
        for k in range(3):
            ml.log(k, {"rollout/reward": 0.1 * k, "staleness/max": 1.0})
    out = tmp_path / "sub" / "dash.png"
    rep = render_report(tmp_path, out=out)
    assert rep.png == out and out.stat().st_size > 10_000
    assert "guards: OK" in rep.verdict


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    synthetic_run(tmp_path, steps=35)
    proc = subprocess.run(
        [sys.executable, "-m", "slime_async.metrics.report", str(tmp_path), "--no-plot"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("steps 1..35") and "WARNING entropy_spike" in proc.stdout


def test_overlay_of_two_runs_has_one_legend_entry_and_colour_per_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from PIL import Image

    a, b = tmp_path / "baseline", tmp_path / "compis"
    synthetic_run(a, steps=40, faults=False, seed=1)
    synthetic_run(b, steps=30, faults=True, seed=2)
    out = tmp_path / "cmp" / "compare.png"
    rep = render_overlay([a, b], out)
    assert rep.png == out and rep.labels == ["baseline", "compis"]
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size[0] > 1500
    assert rep.verdicts["baseline"].startswith("steps 1..40")
    assert rep.verdicts["compis"].startswith("steps 1..30")
    assert not list(out.parent.glob(".compare.png.tmp*"))

    assert main([str(a), str(b), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== baseline\nsteps 1..40" in text and "== compis\nsteps 1..30" in text
    assert main([str(a)]) == 0  # one run: the single-run dashboard, as before
    assert (a / "report.png").is_file() and capsys.readouterr().out.startswith("steps 1..40")


def test_overlay_lines_follow_the_run_colours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each panel draws run i in colour Ci (read from the figure the overlay draws)."""
    import matplotlib.colors as mcolors
    from matplotlib.figure import Figure

    runs = [tmp_path / "x" / "run", tmp_path / "y" / "run"]
    for i, r in enumerate(runs):
        synthetic_run(r, steps=25, faults=False, seed=i)
    assert run_labels(runs) == ["x/run", "y/run"]  # same names: the parent tells them apart
    drawn: list[Figure] = []
    orig = Figure.savefig

    def keep(self: Figure, *a: object, **k: object) -> None:
        drawn.append(self)
        orig(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    rep = render_overlay(runs, tmp_path / "c.png")
    assert rep.labels == ["x/run", "y/run"]
    (fig,) = drawn
    entropy = next(ax for ax in fig.axes if ax.get_title() == "policy entropy")
    colours = [mcolors.to_hex(line.get_color()) for line in entropy.get_lines()]
    assert colours == [mcolors.to_hex("C0"), mcolors.to_hex("C1")]
    legend_colours = [mcolors.to_hex(h.get_color()) for h in fig.legends[0].legend_handles]
    assert legend_colours == colours
