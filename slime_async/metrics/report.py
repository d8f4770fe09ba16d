"""Run report: ``python -m slime_async.metrics.report RUN_DIR`` renders metrics.jsonl into a PNG dashboard;
``python -m slime_async.metrics.report RUN_A RUN_B ...`` overlays several runs on one PNG.

Owns `render_report` (the verdict and the dashboard of one run; the dashboard's panels are
`dashboard.py`'s), `render_overlay` (one line colour per run, the legend names each run by its
directory), the text `verdict`, `guards_for_run` (the guards a run used, from its saved
config.json) and the command line. The verdict replays the divergence guards over the whole run.
Matplotlib is used through its object API with the Agg canvas (no pyplot, no global backend
change). Imports only `slime_async.metrics`; never imports the trainer, engine or controller.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from slime_async.metrics.dashboard import ema, log_y, need_matplotlib, no_data, render_png
from slime_async.metrics.guards import (
    GuardConfig,
    GuardKind,
    GuardWarning,
    saved_run_guard_config,
    scan,
)
from slime_async.metrics.history import MetricsHistory, read_metrics
from slime_async.metrics.logger import METRICS_FILE


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    """What `render_report` produced."""

    png: Path | None
    """The dashboard image (None when plotting was skipped)."""
    verdict: str
    """Short text summary with the guard findings."""
    warnings: list[GuardWarning]
    """Every guard firing over the run, step by step."""


# ---------------------------------------------------------------------------- verdict
def _tail_mean(values: Sequence[float], frac: float = 0.1) -> float:
    if not values:
        return math.nan
    n = max(1, int(len(values) * frac))
    return sum(values[-n:]) / n


def verdict(history: MetricsHistory, warnings: Sequence[GuardWarning]) -> str:
    """A few lines: run length, reward start -> end, eval, and each guard that fired."""
    steps = [r["step"] for r in history.records]
    lines = []
    if not steps:
        return "no metric records in the log"
    lines.append(
        f"steps {steps[0]}..{steps[-1]} ({len(steps)} logged, "
        f"{history.restarts} resume(s), {history.bad_lines} unreadable line(s))"
    )
    _, rew = history.series("rollout/reward")
    if rew:
        first = sum(rew[: max(1, len(rew) // 10)]) / max(1, len(rew) // 10)
        lines.append(f"reward {first:.3f} -> {_tail_mean(rew):.3f} (first/last 10% of steps)")
    _, ev = history.series("eval/reward")
    if ev:
        lines.append(f"eval reward {ev[0]:.3f} -> {ev[-1]:.3f} over {len(ev)} evals")
    if not warnings:
        lines.append("guards: OK, no divergence signal fired")
        return "\n".join(lines)
    by_kind: dict[tuple[GuardKind, str], list[GuardWarning]] = {}
    for w in warnings:
        by_kind.setdefault((w.kind, w.key), []).append(w)
    lines.append(f"guards: {len(by_kind)} signal(s) fired")
    for (kind, key), ws in by_kind.items():
        lines.append(
            f"  WARNING {kind} on {key}: {len(ws)} step(s), first at step "
            f"{ws[0].step}: {ws[0].message}"
        )
    return "\n".join(lines)


def guards_for_run(run_dir: Path) -> GuardConfig:
    """The guards the run itself used: the default thresholds, with the log-prob-gap baseline
    taken after its staleness budget filled (from its config.json; none skipped without one)."""
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return GuardConfig()
    return saved_run_guard_config(saved)


def render_report(
    run_dir: str | Path,
    *,
    out: str | Path | None = None,
    guards: GuardConfig | None = None,
    plot: bool = True,
) -> Report:
    """Read ``run_dir/metrics.jsonl``; write ``run_dir/report.png`` (or ``out``) and a verdict."""
    run_dir = Path(run_dir)
    history = read_metrics(run_dir / METRICS_FILE)
    warnings = scan(history.records, guards or guards_for_run(run_dir))
    text = verdict(history, warnings)
    png = None
    if plot:
        png = render_png(
            history,
            warnings,
            Path(out) if out else run_dir / "report.png",
            title=run_dir.resolve().name,
        )
    return Report(png=png, verdict=text, warnings=warnings)


OVERLAY_PANELS = (
    ("rollout/reward", "rollout reward (EMA)", "ema"),
    ("eval/reward", "eval reward", "points"),
    ("policy/entropy", "policy entropy", "line"),
    ("mismatch/train_rollout_logprob_abs_diff", "|train - rollout| log-prob", "log"),
    ("rollout/length", "response length", "line"),
    ("is/combined/mean", "IS weight mean: combined r2·r3", "line"),
    ("staleness/mean", "staleness mean", "line"),
    ("timing/step_s", "step time, s", "line"),
    ("idle/trainer_ratio", "trainer idle ratio", "line"),
)
"""(metric, panel title, style) of the comparison panels; one line per run in each."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OverlayReport:
    """What `render_overlay` produced."""

    png: Path
    """The comparison image."""
    labels: list[str]
    """The figure legend's entries, one per run, in the order given (read back from the figure)."""
    verdicts: dict[str, str]
    """Each run's `verdict`, by its label."""


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """A legend name per run: its directory name, with parent directories added until the
    names differ (``a/run``, ``b/run``)."""
    paths = [p.resolve() for p in run_dirs]
    for depth in range(1, max(len(p.parts) for p in paths) + 1):
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def _verdicts(
    labels: Sequence[str], histories: Sequence[MetricsHistory], dirs: Sequence[Path]
) -> dict[str, str]:
    return {
        label: verdict(h, scan(h.records, guards_for_run(d)))
        for label, h, d in zip(labels, histories, dirs)
    }


def render_overlay(run_dirs: Sequence[str | Path], out: str | Path) -> OverlayReport:
    """Overlay the runs' main curves (`OVERLAY_PANELS`) on one PNG written atomically to
    ``out``: run i is colour Ci in every panel; a run without a metric simply has no line."""
    need_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    dirs = [Path(d) for d in run_dirs]
    labels = run_labels(dirs)
    histories = [read_metrics(d / METRICS_FILE) for d in dirs]
    verdicts = _verdicts(labels, histories, dirs)
    fig = Figure(figsize=(20, 13), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(3, 3)
    for ax, (key, title, style) in zip((a for row in grid for a in row), OVERLAY_PANELS):
        values: list[float] = []
        for i, h in enumerate(histories):
            s, v = h.series(key)
            if not s:
                continue
            values += v
            color = f"C{i % 10}"
            if style == "ema":
                ax.plot(s, v, color=color, alpha=0.2, lw=0.8)
                ax.plot(s, ema(v, 2 / (1 + max(2, len(v) // 20))), color=color, lw=1.6)
            elif style == "points":
                ax.plot(s, v, "o-", color=color, ms=3.5, lw=1.3)
            else:
                ax.plot(s, v, color=color, lw=1.2)
        if not values:
            no_data(ax, key)
        elif style == "log":
            log_y(ax, values)
        ax.set_title(title)
        ax.set_xlabel("train step", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    handles = [Line2D([], [], color=f"C{i % 10}", lw=2.5) for i in range(len(dirs))]
    legend = fig.legend(handles, labels, loc="outside lower center", ncols=min(len(dirs), 6))
    fig.suptitle(f"{len(dirs)} runs compared", fontsize=14)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return OverlayReport(
        png=out, labels=[t.get_text() for t in legend.get_texts()], verdicts=verdicts
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m slime_async.metrics.report",
        description="Render a run's metrics.jsonl into a PNG dashboard and a guard verdict; "
        "given several run directories, overlay their main curves on one PNG (one colour per "
        "run) and print each run's verdict.",
    )
    ap.add_argument("run_dir", nargs="+", help="run directory holding metrics.jsonl (or several)")
    ap.add_argument(
        "--out",
        default=None,
        help="PNG path (default: RUN_DIR/report.png; with several runs: ./compare.png)",
    )
    ap.add_argument("--no-plot", action="store_true", help="print the verdict(s) only")
    args = ap.parse_args(argv)
    if len(args.run_dir) > 1:
        return _compare(args.run_dir, out=args.out or "compare.png", plot=not args.no_plot)
    try:
        rep = render_report(args.run_dir[0], out=args.out, plot=not args.no_plot)
    except (FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(rep.verdict)
    if rep.png is not None:
        print(f"report: {rep.png}")
    return 0


def _compare(run_dirs: Sequence[str], *, out: str, plot: bool) -> int:
    try:
        if plot:
            rep = render_overlay(run_dirs, out)
            verdicts, png = rep.verdicts, rep.png
        else:
            dirs = [Path(d) for d in run_dirs]
            histories = [read_metrics(d / METRICS_FILE) for d in dirs]
            verdicts = _verdicts(run_labels(dirs), histories, dirs)
            png = None
    except (FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n\n".join(f"== {label}\n{text}" for label, text in verdicts.items()))
    if png is not None:
        print(f"report: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
