"""The stability lab's outputs: its figure grid and its markdown report.

Owns `render_figure` (rows = the `PANELS` metrics over samples trained, columns = (staleness,
steps per rollout), one line per (loss, replay), mean ± one standard deviation over seeds) and
`render_markdown` (the table of final values, per-source diagnostics, seed-paired and pooled
differences, per-run verdicts, the goal checks against `lab.goals.GOALS`, the guards' hit
rates), both from `lab.analysis`. matplotlib is imported only to draw. May import
`slime_async`; `slime_async` must never import it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.analysis import LOSSES, SOURCES, RunData, group_key, split_group
from lab.goals import GOALS, Goals
from slime_async.metrics.stability import GAP_KEY

PANELS: tuple[tuple[str, str], ...] = (
    ("rollout/reward", "train reward"),
    ("eval/reward", "eval reward"),
    (GAP_KEY, "train–rollout |Δ log-prob|"),
    ("policy/entropy", "entropy"),
    ("is/combined/p99", "π_k/π_SGL IS p99"),
    ("is/staleness/p99", "staleness r3 IS p99"),
    ("is/engine/p99", "engine r2 IS p99"),
    ("is/drift/p99", "drift r1 IS p99"),
    ("train/grad_norm", "grad norm"),
)
"""(metric key, row title) of the figure."""


COLORS = {
    "ppo": "tab:red",
    "decoupled_ppo": "tab:orange",
    "tis": "tab:purple",
    "is": "tab:green",
    "icepop": "tab:brown",
    "compis": "tab:blue",
}
"""The figure's colour of each loss of `lab.analysis.LOSSES`."""


def _smooth(ys: Sequence[float], w: int) -> list[float]:
    if w <= 1:
        return list(ys)
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= w:
            acc -= ys[i - w]
        out.append(acc / min(i + 1, w))
    return out


def render_figure(runs: Sequence[RunData], path: Path, *, smooth: float) -> None:
    """The figure grid (see the module docstring)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = sorted({(r.cell.staleness, r.cell.nspr) for r in runs})
    lines = sorted(
        {(r.cell.loss, r.cell.replay) for r in runs},
        key=lambda t: (list(LOSSES).index(t[0]), not t[1]),
    )
    fig = Figure(figsize=(3.4 * len(cols) + 1, 2.1 * len(PANELS)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), len(cols), squeeze=False, sharex="col")
    for j, (s, n) in enumerate(cols):
        for i, (key, title) in enumerate(PANELS):
            ax = axes[i][j]
            if i == 0:
                ax.set_title(f"staleness {s}, {n} step(s)/rollout", fontsize=9)
            if j == 0:
                ax.set_ylabel(title, fontsize=8)
            ax.tick_params(which="both", labelsize=7)
            for loss, rr in lines:
                seeds = [
                    r
                    for r in runs
                    if (r.cell.staleness, r.cell.nspr, r.cell.loss, r.cell.replay)
                    == (s, n, loss, rr)
                ]
                curves = [r.series(key) for r in seeds]
                curves = [c for c in curves if c[0]]
                if not curves:
                    continue
                grid_x = np.array(
                    sorted(set(curves[0][0]).intersection(*[set(c[0]) for c in curves]))
                )
                if grid_x.size == 0:
                    continue
                w = max(1, int(len(grid_x) * smooth)) if key != "eval/reward" else 1
                ys = np.array(
                    [_smooth([dict(zip(*c, strict=True))[x] for x in grid_x], w) for c in curves]
                )
                m, sd = ys.mean(0), ys.std(0)
                style = "-" if rr else "--"
                label = f"{loss}{'' if rr else ' (no R3)'} ×{len(curves)}"
                ax.plot(
                    grid_x,
                    m,
                    style,
                    color=COLORS[loss],
                    lw=1.2,
                    label=label,
                    marker="o" if key == "eval/reward" else None,
                    ms=3,
                )
                ax.fill_between(grid_x, m - sd, m + sd, color=COLORS[loss], alpha=0.15, lw=0)
            if key.startswith("is/") or key in (GAP_KEY, "train/grad_norm"):
                ax.set_yscale("log")
            if i == len(PANELS) - 1:
                ax.set_xlabel("samples trained", fontsize=8)
        axes[0][j].legend(fontsize=6, loc="lower right")
    fig.suptitle("stability lab: mean ± 1 sd over seeds", fontsize=10)
    fig.savefig(path, dpi=90)


def render_markdown(an: dict[str, Any], runs: Sequence[RunData], command: str) -> str:
    """The table of final values, the verdicts, the goal checks and the guard calibration."""
    budgets = sorted({r.budget() for r in runs})
    lines = [
        f"Command: `{command}`",
        "",
        f"Budget per run (from each run's config.json): {'; or '.join(budgets)}.",
        "",
        "| cell | seeds | verdict | final eval reward | eval SE (max) | end train reward "
        "| gap start | gap end | gap end/start | staleness mean | staleness max | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in sorted(an["cells"], key=group_key):
        c = an["cells"][g]
        lines.append(
            f"| `{g}` | {c['seeds']} | {c['verdict']} ({c['counts']}) | {_fmt(*c['eval_final'])} "
            f"| {c['eval_se'][0]:.3f} | {_fmt(*c['reward_end'])} | {_fmt(*c['gap_start'], 4)} "
            f"| {_fmt(*c['gap_end'], 4)} | {_fmt(*c['gap_ratio'], 2)} "
            f"| {_fmt(*c['staleness_mean'], 2)} | {_fmt(*c['staleness_max'], 1)} "
            f"| {c['wall_s'][0]:.0f} |"
        )
    lines += [
        "",
        "Values are mean ± the 95% Student-t half-width over seeds.",
        "",
        "Per-source diagnostics (run means; r2/r3 need π_j^Meg, which only compis reads):",
        "",
        "| cell | engine gap | π_k/π_SGL p99 | r3 p99 | r2 p99 | r1 p99 "
        "| r3 clipped | r2 clipped | PPO clipfrac |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in sorted(an["cells"], key=group_key):
        c = an["cells"][g]
        p99 = " | ".join(_fmt(*c[f"is_p99/{s}"], 3) for s in SOURCES)
        lines.append(
            f"| `{g}` | {_fmt(*c['engine_gap'], 4)} | {p99} "
            f"| {_fmt(*c['clipped_frac/staleness'], 4)} "
            f"| {_fmt(*c['clipped_frac/engine'], 4)} | {_fmt(*c['ppo_clipfrac'], 4)} |"
        )
    lines += [
        "",
        "Seed-paired differences (same seed = same warm start, eval prompts and prompt "
        "order; the seeds differ far more than the cells do):",
        "",
        "| cell | minus | seeds | Δ final eval | Δ end train reward | Δ gap end |",
        "|---|---|---|---|---|---|",
    ]
    for g in sorted(an["cells"], key=group_key):
        c = an["cells"][g]
        for key, label in (
            ("vs_sync", "sync, same loss"),
            ("vs_ppo", "ppo, same staleness"),
            ("vs_rron", "R3 on"),
        ):
            if d := c.get(key):
                lines.append(
                    f"| `{g}` | {label} | {d['seeds'][0]:.0f} "
                    f"| {_fmt(*d['eval_final'])} | {_fmt(*d['reward_end'])} "
                    f"| {_fmt(*d['gap_end'], 4)} |"
                )
    lines += pooled_table(an.get("vs_sync", {}))
    lines += ["", "Per run (verdict, the rule that decided it, guards that fired):", ""]
    for name in sorted(an["runs"], key=group_key):
        r = an["runs"][name]
        lines.append(
            f"* `{name}`: **{r['verdict']}**: {r['why']}; guards: "
            f"{', '.join(r['guards']) or 'none'}"
        )
    lines += ["", *goal_checks(an), "", *guard_table(an["guards"])]
    return "\n".join(lines) + "\n"


def _fmt(m: float, h: float, digits: int = 3) -> str:
    if not math.isfinite(m):
        return "–"
    return f"{m:.{digits}f} ± {h:.{digits}f}" if math.isfinite(h) else f"{m:.{digits}f}"


def pooled_table(vs: dict[str, dict[str, dict[str, list[float]]]]) -> list[str]:
    """The pooled async − sync differences as one table per measure: loss × staleness."""
    if not vs:
        return []
    cols = sorted({st for by in vs.values() for st in by}, key=lambda k: int(k[1:]))
    out = [
        "",
        "Async minus sync, seed-paired and pooled over routing replay and steps per "
        "rollout (mean ± 95% t half-width, pairs):",
    ]
    for key, what in (
        ("reward_end", "end train reward"),
        ("eval_final", "final eval reward"),
        ("gap_end", "train–rollout gap at the end"),
    ):
        out += ["", f"| {what} | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for loss in sorted(vs, key=lambda x: list(LOSSES).index(x) if x in LOSSES else 99):
            cells = []
            for st in cols:
                v = vs[loss].get(st, {}).get(key)
                cells.append(
                    "–"
                    if v is None
                    else f"{_fmt(v[0], v[1], 4 if key == 'gap_end' else 3)} ({v[2]:.0f})"
                )
            out.append(f"| `{loss}` | " + " | ".join(cells) + " |")
    return out


def goal_checks(an: dict[str, Any], goals: Goals = GOALS) -> list[str]:
    """The lab's `goals`, checked on whatever cells ran."""
    cells = an["cells"]
    relax = f"{100 * goals.replay_change:.0f}%".replace("-", "\u2212")
    out = ["Goal checks (the lab's bars, on the cells that ran):", ""]
    top = max((int(g.split("-")[0][1:]) for g in cells), default=None)
    if top is None:
        out.append("* no cells")
    for g, c in sorted(cells.items()):
        s, loss, rr, n = split_group(g)
        if s != top:
            continue
        if loss == "ppo":
            ok = c["gap_ratio"][0] >= goals.drift_gap_ratio or c["verdict"] != "stable"
            out.append(
                f"* `{g}` uncorrected PPO drifts (gap end/start "
                f"≥ {goals.drift_gap_ratio:g} or reward falling): "
                f"{'yes' if ok else 'no'} (gap end/start {_fmt(*c['gap_ratio'], 2)}, "
                f"verdict {c['verdict']})"
            )
        if loss == "compis":
            sync = cells.get(f"s0-compis-{rr}-{n}") if s else None
            flat = c["gap_ratio"][0] <= goals.flat_gap_ratio
            line = (
                f"* `{g}` CompIS flat (gap end/start ≤ {goals.flat_gap_ratio:g}): "
                f"{'yes' if flat else 'no'} "
                f"({_fmt(*c['gap_ratio'], 2)})"
            )
            if sync is not None and c.get("vs_sync"):
                d, h = c["vs_sync"]["eval_final"]
                near = abs(d) <= goals.eval_vs_sync
                line += (
                    f"; final eval within {goals.eval_vs_sync:g} of sync "
                    f"`s0-compis-{rr}-{n}`: {'yes' if near else 'no'} (seed-paired "
                    f"difference {_fmt(d, h)}, {c['vs_sync']['seeds'][0]:.0f} seeds)"
                )
            out.append(line)
    for g, c in sorted(cells.items()):
        s, loss, rr, n = split_group(g)
        if rr == "rroff" and (d := c.get("vs_rron")):
            k = d["seeds"][0]
            parts = []
            for key, what in (
                ("gap_end", "train–rollout gap (end window)"),
                ("engine_gap", "engine gap |log π_j^Meg − log π_SGL| (run mean)"),
            ):
                off = c[key][0]  # the R3-off cell's mean; d[key] = off − on, paired by seed
                red, h = -d[key][0] / off, d[key][1] / off
                parts.append(f"{what} {100 * red:+.0f}% ± {100 * h:.0f}% (R3 off: {off:.4f})")
            out.append(
                f"* routing replay at `s{s}-{loss}-{n}`, change with R3 vs without "
                f"({k:.0f} seed-paired): {'; '.join(parts)}; Relax's figure: {relax} "
                f"or better"
            )
    for key, what in (
        ("gap_end", "train–rollout gap (end window)"),
        ("engine_gap", "engine gap |log π_j^Meg − log π_SGL|"),
    ):
        rows = an.get("replay", {}).get(key, {})
        if not rows or not rows["all"][3]:
            continue
        each = ", ".join(
            f"{k} {100 * v[0]:+.0f}% ({v[3]:.0f})" for k, v in rows.items() if k != "all"
        )
        m, lo, hi, k = rows["all"]
        bar = goals.replay_change
        met = "yes" if hi <= bar else ("no" if lo > bar else "not resolved")
        out.append(
            f"* routing replay, pooled over {k:.0f} seed-paired run pairs, {what}: "
            f"{100 * m:+.0f}% [{100 * lo:+.0f}%, {100 * hi:+.0f}%] (geometric mean "
            f"on/off, 95% interval); {relax} or better: {met}. By staleness: {each}"
        )
    return out


def guard_table(cal: dict[str, Any]) -> list[str]:
    """Markdown: each guard's hit rate on unstable vs stable runs per threshold value."""
    nu, ns = cal["n_unstable"], cal["n_stable"]
    out = [
        f"Divergence guards (`slime_async/metrics/guards.py`) on the {nu} unstable "
        f"(drifting/collapsed) and {ns} stable runs; * marks the default threshold:",
        "",
        "| guard | threshold | fired on unstable | fired on stable |",
        "|---|---|---|---|",
    ]
    for kind, sw in cal["sweep"].items():
        for row in sw["rows"]:
            star = "*" if row["default"] else ""
            out.append(
                f"| {kind} | {sw['field']}={row['value']:g}{star} | "
                f"{row['unstable_hits']}/{nu} | {row['stable_hits']}/{ns} |"
            )
    return out
