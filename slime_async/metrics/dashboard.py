"""The single-run PNG dashboard: `render_png` and its panels.

Owns `render_png` (a 3 x 4 grid: reward and eval, entropy, train/rollout log-prob diff,
rollout log-prob and length, IS percentiles per source (staleness r3, engine r2, drift r1,
combined r2*r3), staleness histogram, staleness over time, timing breakdown, idle ratios; the
guard warnings as red bands), the panel helpers the overlay shares (`ema`, `log_y`,
`no_data`) and `need_matplotlib`. Matplotlib is used through its object API with the Agg
canvas (no pyplot, no global backend change). Imports only `slime_async.metrics`.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slime_async.metrics.guards import GuardKind, GuardWarning
from slime_async.metrics.history import MetricsHistory

IS_SOURCES = (
    ("staleness", "staleness r3"),
    ("engine", "engine r2"),
    ("drift", "drift r1"),
    ("combined", "combined r2·r3"),
)
_PCTS = (("p50", "-", 1.2), ("p90", "-", 1.0), ("p99", "--", 1.0), ("max", ":", 1.0))


def no_data(ax: Any, what: str) -> None:
    ax.text(
        0.5, 0.5, f"no {what} logged", ha="center", va="center", color="0.5", transform=ax.transAxes
    )


def ema(values: Sequence[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def log_y(ax: Any, values: Sequence[float]) -> None:
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
            ema(v, 2 / (1 + max(2, len(v) // 20))),
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
        no_data(ax, "reward")
    ax.set_title("reward")
    ax.set_ylim(-0.02, 1.02) if all(0 <= x <= 1 for x in h.series("rollout/reward")[1]) else None


def _panel_simple(ax: Any, h: MetricsHistory, key: str, title: str, *, log: bool = False) -> None:
    if not _line(ax, h, key, "_", color="tab:purple", lw=1.2):
        no_data(ax, key)
    elif log:
        log_y(ax, h.series(key)[1])
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
        no_data(ax, "rollout log-prob or length")
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
        no_data(ax, f"is/{source}/*")
        ax.set_title(f"IS weight: {title}")
        return
    ax.axhline(1.0, color="0.6", lw=0.8)
    log_y(ax, values)
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
    no_data(ax, "staleness")
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
        no_data(ax, "staleness")
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
        no_data(ax, "timing/*")
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
        no_data(ax, "idle ratios")
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
            ax = axes.get(where.get(w.kind, ""))
        if ax is not None:
            ax.axvline(w.step, color="red", alpha=0.25, lw=2)


def need_matplotlib() -> None:
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
    need_matplotlib()
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
