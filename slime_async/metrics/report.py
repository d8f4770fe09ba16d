"""Run report: ``python -m slime_async.metrics.report RUN_DIR`` renders metrics.jsonl into a PNG dashboard;
``python -m slime_async.metrics.report RUN_A RUN_B ...`` overlays several runs on one PNG.

Owns `render_report`, `render_overlay` (one line colour per run, the legend names each run by its
directory) and the text `verdict`. Panels: reward and eval, entropy, train/rollout
log-prob diff, rollout log-prob and length, IS percentiles per source (staleness r3, engine r2,
drift r1, combined r2*r3), staleness histogram, staleness over time, timing breakdown, idle
ratios. The verdict replays the divergence guards over the whole run. Matplotlib is used through
its object API with the Agg canvas (no pyplot, no global backend change). Imports only
`slime_async.metrics`; never imports the trainer, engine or controller.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data_worker.config import data_worker_config_from_record
from slime_async.metrics.guards import (
    GuardConfig,
    GuardKind,
    GuardWarning,
    run_guard_config,
    scan,
)
from slime_async.metrics.history import MetricsHistory, read_metrics
from slime_async.metrics.logger import METRICS_FILE

IS_SOURCES = (
    ("staleness", "staleness r3"),
    ("engine", "engine r2"),
    ("drift", "drift r1"),
    ("combined", "combined r2·r3"),
)
_PCTS = (("p50", "-", 1.2), ("p90", "-", 1.0), ("p99", "--", 1.0), ("max", ":", 1.0))


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


# ---------------------------------------------------------------------------- panels
def _no_data(ax: Any, what: str) -> None:
    ax.text(
        0.5, 0.5, f"no {what} logged", ha="center", va="center", color="0.5", transform=ax.transAxes
    )


def _ema(values: Sequence[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def _log_y(ax: Any, values: Sequence[float]) -> None:
    """Log y axis (plain tick labels) when the positive ``values`` span > 5x; else linear."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if not values or min(values) <= 0 or max(values) / min(values) < 5:
        return
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:.3g}")
    ax.yaxis.set_major_formatter(plain)
    ratio = max(values) / min(values)
    ax.yaxis.set_minor_formatter(plain if ratio < 20 else NullFormatter())


def _line(ax: Any, h: MetricsHistory, key: str, label: str | None = None, **kw: Any) -> bool:
    s, v = h.series(key)
    if s:
        ax.plot(s, v, label=label or key, **kw)
    return bool(s)


def _panel_reward(ax: Any, h: MetricsHistory) -> None:
    s, v = h.series("rollout/reward")
    any_data = bool(s)
    if s:
        ax.plot(s, v, color="tab:blue", alpha=0.3, lw=0.8)
        ax.plot(
            s,
            _ema(v, 2 / (1 + max(2, len(v) // 20))),
            color="tab:blue",
            lw=1.8,
            label="rollout (EMA)",
        )
    s, v = h.series("eval/reward")
    if s:
        any_data = True
        se_s, se_v = h.series("eval/reward_se")
        if se_s == s:  # standard error bars when the run logged them
            ax.errorbar(
                s,
                v,
                yerr=se_v,
                fmt="o-",
                color="tab:red",
                ms=3.5,
                lw=1.5,
                capsize=2,
                label="eval (± s.e.)",
            )
        else:
            ax.plot(s, v, "o-", color="tab:red", ms=3.5, lw=1.5, label="eval")
    s, v = h.series("eval/pass")
    if s:
        ax.plot(s, v, "s--", color="tab:orange", ms=3, lw=1.0, label="eval pass (=1)")
    levels = sorted(k for k in h.metric_keys() if k.startswith("eval/reward_level"))
    for i, k in enumerate(levels):
        s, v = h.series(k)
        ax.plot(
            s,
            v,
            "-",
            lw=0.8,
            alpha=0.7,
            color=f"C{(i + 3) % 10}",
            label=k.removeprefix("eval/reward_"),
        )
    if not any_data:
        _no_data(ax, "reward")
    ax.set_title("reward")
    ax.set_ylim(-0.02, 1.02) if all(0 <= x <= 1 for x in h.series("rollout/reward")[1]) else None


def _panel_simple(ax: Any, h: MetricsHistory, key: str, title: str, *, log: bool = False) -> None:
    if not _line(ax, h, key, "_", color="tab:purple", lw=1.2):
        _no_data(ax, key)
    elif log:
        _log_y(ax, h.series(key)[1])
    ax.set_title(title)


def _panel_rollout(ax: Any, h: MetricsHistory) -> None:
    ok = _line(ax, h, "rollout/logprob_mean", "log-prob mean", color="tab:green")
    s, v = h.series("rollout/length")
    if s:
        ax2 = ax.twinx()
        ax2.plot(s, v, color="tab:orange", lw=1.0, alpha=0.8, label="length")
        ax2.set_ylabel("response length", color="tab:orange", fontsize=8)
        ax2.tick_params(labelsize=7)
    if not ok and not s:
        _no_data(ax, "rollout log-prob or length")
    ax.set_title("rollout log-prob (green) and length (orange)")


def _panel_is(ax: Any, h: MetricsHistory, source: str, title: str) -> None:
    drawn = False
    for i, (p, style, lw) in enumerate(_PCTS):
        drawn |= _line(ax, h, f"is/{source}/{p}", p, ls=style, lw=lw, color=f"C{i}")
    drawn |= _line(ax, h, f"is/{source}/mean", "mean", color="k", lw=1.6)
    values = [
        v for p in ("p50", "p90", "p99", "max", "mean") for v in h.series(f"is/{source}/{p}")[1]
    ]
    if not drawn:
        _no_data(ax, f"is/{source}/*")
        ax.set_title(f"IS weight: {title}")
        return
    ax.axhline(1.0, color="0.6", lw=0.8)
    _log_y(ax, values)
    _, masked = h.series(f"is/{source}/masked_frac")
    _, clipped = h.series(f"is/{source}/clipped_frac")
    extra = []
    if masked:
        extra.append(f"masked {100 * sum(masked) / len(masked):.2g}%")
    if clipped:
        extra.append(f"clipped {100 * sum(clipped) / len(clipped):.2g}%")
    ax.set_title(f"IS weight: {title}" + (f"  ({', '.join(extra)})" if extra else ""))


def _panel_staleness_hist(ax: Any, h: MetricsHistory) -> None:
    total: Counter[int] = Counter()
    for r in h.records:
        hist = r.get("staleness/hist")
        if isinstance(hist, list):
            for i, c in enumerate(hist):
                if isinstance(c, (int, float)) and math.isfinite(c):
                    total[i] += int(c)
    if total:
        xs = range(max(total) + 1)
        ax.bar(list(xs), [total[x] for x in xs], color="tab:cyan", edgecolor="k", lw=0.5)
        ax.set_xticks(list(xs))
        ax.set_xlabel("staleness k - j (steps)")
        ax.set_ylabel("trained groups (k - j_min)")
        ax.set_title("staleness histogram (all steps)")
        return
    s, v = h.series("staleness/max")
    if s:
        counts = Counter(round(x) for x in v)
        xs = range(max(counts) + 1)
        ax.bar(list(xs), [counts[x] for x in xs], color="tab:cyan", edgecolor="k", lw=0.5)
        ax.set_xticks(list(xs))
        ax.set_xlabel("max staleness of a step")
        ax.set_ylabel("steps")
        ax.set_title("staleness (per-step max; no staleness/hist logged)")
        return
    _no_data(ax, "staleness")
    ax.set_title("staleness histogram")


def _panel_staleness_time(ax: Any, h: MetricsHistory) -> None:
    ok = _line(ax, h, "staleness/mean", "mean", color="tab:blue")
    ok |= _line(ax, h, "staleness/max", "max", color="tab:red", lw=0.8)
    s, v = h.series("staleness/dropped")
    if s and max(v) > 0:
        ax2 = ax.twinx()
        ax2.plot(s, v, color="0.4", ls="--", lw=0.9)
        ax2.set_ylabel("dropped groups (dashed)", fontsize=8)
        ax2.tick_params(labelsize=7)
    if not ok and not s:
        _no_data(ax, "staleness")
    ax.set_title("staleness over steps")


def _panel_timing(ax: Any, h: MetricsHistory, *, top: int = 6) -> None:
    means = {}
    for k in h.metric_keys():
        if k.startswith("timing/") and k != "timing/elapsed_s":
            _, v = h.series(k)
            if v:
                means[k] = sum(v) / len(v)
    keys = sorted(means, key=means.get, reverse=True)[:top]
    for i, k in enumerate(keys):
        lw = 1.8 if k == "timing/step_s" else 1.0
        _line(ax, h, k, f"{k.removeprefix('timing/')} ({means[k]:.2g}s)", lw=lw, color=f"C{i}")
    if not keys:
        _no_data(ax, "timing/*")
    hidden = len(means) - len(keys)
    ax.set_title(
        "timing, s per step" + (f" (top {top}; {hidden} more in the log)" if hidden else "")
    )


def _panel_idle(ax: Any, h: MetricsHistory) -> None:
    parts = []
    for key, name, color in (
        ("idle/trainer_ratio", "trainer", "tab:red"),
        ("idle/rollout_ratio", "rollout", "tab:blue"),
    ):
        s, v = h.series(key)
        if s:
            ax.plot(s, v, color=color, lw=1.2, label=name)
            parts.append(f"{name} {sum(v) / len(v):.2f}")
    if not parts:
        _no_data(ax, "idle ratios")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("idle ratio" + (f" (mean: {', '.join(parts)})" if parts else ""))


# ---------------------------------------------------------------------------- rendering
def _mark_warnings(axes: dict[str, Any], warnings: Sequence[GuardWarning]) -> None:
    where = {
        GuardKind.ENTROPY_SPIKE: "entropy",
        GuardKind.LOGPROB_DIFF_DRIFT: "diff",
        GuardKind.ROLLOUT_LOGPROB_TREND: "rollout",
    }
    for w in warnings:
        if w.kind is GuardKind.IS_WEIGHT_RANGE:
            ax = axes.get(w.key.split("/")[1])
        else:
            ax = axes.get(where[w.kind])
        if ax is not None:
            ax.axvline(w.step, color="red", alpha=0.25, lw=2)


def _need_matplotlib() -> None:
    """The PNGs need matplotlib, an optional dependency (``slime-async[report]``); the verdicts
    do not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "the PNG report needs matplotlib: pip install 'slime-async[report]' "
            "(or pass --no-plot for the verdict only)"
        ) from e


def render_png(
    history: MetricsHistory, warnings: Sequence[GuardWarning], out: Path, *, title: str
) -> Path:
    """Draw the dashboard into ``out`` (written atomically)."""
    _need_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(22, 13), dpi=90, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(3, 4)
    axes = {
        "reward": grid[0][0],
        "entropy": grid[0][1],
        "diff": grid[0][2],
        "rollout": grid[0][3],
        "staleness": grid[1][0],
        "engine": grid[1][1],
        "drift": grid[1][2],
        "combined": grid[1][3],
    }
    _panel_reward(axes["reward"], history)
    _panel_simple(axes["entropy"], history, "policy/entropy", "policy entropy")
    _panel_simple(
        axes["diff"],
        history,
        "mismatch/train_rollout_logprob_abs_diff",
        "|train - rollout| log-prob",
        log=True,
    )
    _panel_rollout(axes["rollout"], history)
    for source, name in IS_SOURCES:
        _panel_is(axes[source], history, source, name)
    _panel_staleness_hist(grid[2][0], history)
    _panel_staleness_time(grid[2][1], history)
    _panel_timing(grid[2][2], history)
    _panel_idle(grid[2][3], history)
    _mark_warnings(axes, warnings)
    for ax in (a for row in grid for a in row):
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
        if ax is not grid[2][0]:
            ax.set_xlabel("train step", fontsize=8)
    n_warn = len({(w.kind, w.key) for w in warnings})
    status = "guards OK" if not warnings else f"{n_warn} guard signal(s) fired (red bands)"
    fig.suptitle(f"{title}: {status}", fontsize=14, color="darkred" if warnings else "black")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


def guards_for_run(run_dir: Path) -> GuardConfig:
    """The guards the run itself used: the default thresholds, with the log-prob-gap baseline
    taken after its staleness budget filled (from its config.json; none skipped without one)."""
    try:
        dw = json.loads((run_dir / "config.json").read_text()).get("data_worker", {})
    except (OSError, ValueError):
        return GuardConfig()
    return run_guard_config(data_worker_config_from_record(dw))


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
    _need_matplotlib()
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
                ax.plot(s, _ema(v, 2 / (1 + max(2, len(v) // 20))), color=color, lw=1.6)
            elif style == "points":
                ax.plot(s, v, "o-", color=color, ms=3.5, lw=1.3)
            else:
                ax.plot(s, v, color=color, lw=1.2)
        if not values:
            _no_data(ax, key)
        elif style == "log":
            _log_y(ax, values)
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
