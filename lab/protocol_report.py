"""The staleness sweep's analysis and results in the protocol's terms (docs/stability-protocol.md).

Owns what the protocol reports beyond the lab's per-cell table: the search's outcome per regime
(`regime_outcome`), the equivalence tests of every async arm against sync (`equivalence_rows`),
CompIS against the uncorrected arm, the speedups (`speedups`), the length bias of the
staleness drop (`length_bias`), the early-warning lead times and false alarms (`early_warning`,
with `onset_step`: the first step at which the run's verdict rules, applied to the steps so far,
call it unstable), and the markdown of it all (`render_protocol`; phase 3's: `render_phase3`). Pure over read-back runs
(`lab.analysis.RunData`) and `lab.analysis.analyse`'s per-run dict.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from lab.analysis import GUARD_SWEEP, RunData, fill_steps, run_guards
from lab.protocol import (
    ARMS,
    ASYNC_ARMS,
    MARGIN,
    PRIMARY_STALENESS,
    STALENESS,
    UNLEARN,
    RegimeOutcome,
    paired_diffs,
    tost,
)
from slime_async.metrics.guards import GuardKind, scan
from slime_async.metrics.stability import (
    Verdict,
    VerdictRules,
    mean_ci,
    summarize,
    verdict,
)

SYNC = "s0-ppo-rron-n1"
EARLY_WARNING = (GuardKind.IS_ESS_LOW, GuardKind.GRAD_COSINE_LOW)
"""The guards whose lead time the protocol measures (the others are reported by the lab)."""


def group_of(arm: str, staleness: int, *, replay: bool = True) -> str:
    """The lab's cell name of a protocol arm."""
    s = 0 if arm == "sync" else staleness
    return f"s{s}-{ARMS[arm]}-rr{'on' if replay else 'off'}-n1"


def _finals(per_run: Mapping[str, Any]) -> dict[str, float]:
    return {n: r["eval_final"] for n, r in per_run.items() if math.isfinite(r["eval_final"])}


def regime_outcome(regime: str, per_run: Mapping[str, Any]) -> RegimeOutcome:
    """The search's reading of one regime's runs."""
    none = group_of("none", PRIMARY_STALENESS)
    syncs = [r for r in per_run.values() if r["group"] == SYNC]
    nones = [r for r in per_run.values() if r["group"] == none]
    _, diffs = paired_diffs(_finals(per_run), none, SYNC)
    return RegimeOutcome(
        regime=regime,
        sync_stable=len(syncs) >= 2
        and all(
            r["verdict"] == Verdict.STABLE
            and r.get("eval_first", -math.inf) - r["eval_final"] <= UNLEARN
            for r in syncs
        ),
        none_minus_sync=statistics.fmean(diffs) if diffs else math.nan,
        none_unstable=any(r["verdict"] != Verdict.STABLE for r in nones),
    )


def _phase2_cells() -> list[tuple[str, int, bool]]:
    """Phase 2's async cells as (arm, staleness, R3), the primary cell first."""
    cells = [("compis", PRIMARY_STALENESS, True)] + [
        (arm, s, True)
        for s in STALENESS
        for arm in ASYNC_ARMS
        if (arm, s) != ("compis", PRIMARY_STALENESS)
    ]
    return cells + [(arm, PRIMARY_STALENESS, False) for arm in ("none", "compis")]


def equivalence_rows(
    per_run: Mapping[str, Any],
    cells: Sequence[tuple[str, int, bool]] | None = None,
    *,
    sync: str = SYNC,
) -> list[dict[str, Any]]:
    """TOST of every async cell (`cells`: (arm, staleness, R3); phase 2's by default)
    against the `sync` cell on the same seeds."""
    finals = _finals(per_run)
    out = []
    for arm, s, rr in _phase2_cells() if cells is None else cells:
        g = group_of(arm, s, replay=rr)
        _, diffs = paired_diffs(finals, g, sync)
        row: dict[str, Any] = {"cell": g, "arm": arm, "staleness": s, "r3": rr, "n": len(diffs)}
        if len(diffs) >= 2:
            t = tost(diffs)
            row.update(mean=t.mean, low=t.low, high=t.high, equivalent=t.equivalent)
        out.append(row)
    return out


def compis_vs_none(
    per_run: Mapping[str, Any], staleness: int = PRIMARY_STALENESS, *, replay: bool = True
) -> tuple[int, float, float]:
    """(pairs, mean, 95% half-width) of compis − none at `staleness`."""
    _, d = paired_diffs(
        _finals(per_run),
        group_of("compis", staleness, replay=replay),
        group_of("none", staleness, replay=replay),
    )
    m, h = mean_ci(d)
    return len(d), m, h


def speedups(
    per_run: Mapping[str, Any],
    arm: str = "compis",
    staleness: int = PRIMARY_STALENESS,
    *,
    replay: bool = True,
    max_load: float = math.inf,
) -> list[tuple[int, float]]:
    """(seed, sync wall / async wall) for the arm at `staleness`, per seed; with `max_load`,
    only seeds whose two runs each kept the node's mean load at or below it (a run whose load
    is not known does not count then)."""
    g, sync = group_of(arm, staleness, replay=replay), group_of("sync", 0, replay=replay)
    walls = {n: r["wall_s"] for n, r in per_run.items()}
    seeds, _ = paired_diffs(walls, g, sync)
    pairs = [(f"{sync}-seed{s}", f"{g}-seed{s}", s) for s in seeds]
    if math.isfinite(max_load):
        pairs = [
            (a, b, s)
            for a, b, s in pairs
            if all(per_run[n].get("load", math.nan) <= max_load for n in (a, b))
        ]
    return [(s, walls[a] / walls[b]) for a, b, s in pairs]


def length_bias(runs: Sequence[RunData]) -> dict[str, list[float]]:
    """Cell -> the final `length/trained_bias` of each of its runs."""
    out: dict[str, list[float]] = {}
    for r in runs:
        v = r.last("length/trained_bias")
        if math.isfinite(v):
            out.setdefault(r.cell.group, []).append(v)
    return out


MIN_ONSET_STEPS = 10
"""Steps before the onset search starts (the verdict's windows need some steps)."""


def onset_step(r: RunData, rules: VerdictRules) -> int | None:
    """The first step at which the verdict rules, applied to the run's steps so far, judge it
    unstable (None when they never do)."""
    train = [x for x in r.records if "rollout/reward" in x]
    fill = fill_steps(r)
    for t in range(MIN_ONSET_STEPS, len(train) + 1):
        v, _ = verdict(summarize(train[:t], rules, fill_steps=fill), rules)
        if v is not Verdict.STABLE:
            return int(train[t - 1]["step"])
    return None


def early_warning(
    runs: Sequence[tuple[str, RunData, str]],
    rules: VerdictRules,
    settings: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Per early-warning guard, over `(label, run, verdict)` triples: for every unstable run,
    the step it first fired and the lead over the run's onset; for every sync run, whether it
    fired (a false alarm). `settings`: guard-config fields to override (a calibration value)."""
    out: dict[str, Any] = {}
    onsets = {label: onset_step(r, rules) for label, r, v in runs if v != Verdict.STABLE}
    for kind in EARLY_WARNING:
        unstable, sync_alarms, sync_n, stable_alarms, stable_n = [], 0, 0, 0, 0
        for label, r, v in runs:
            cfg = dataclasses.replace(run_guards(r), **(settings or {}))
            fired = [w.step for w in scan(r.records, cfg) if w.kind is kind]
            first = min(fired, default=None)
            if r.cell.staleness == 0:  # synchronous, with or without routing replay
                sync_n += 1
                sync_alarms += first is not None
            elif v == Verdict.STABLE:  # an async run the verdict calls healthy
                stable_n += 1
                stable_alarms += first is not None
            else:
                onset = onsets[label]
                lead = None if first is None or onset is None else onset - first
                unstable.append({"run": label, "fired": first, "onset": onset, "lead": lead})
        out[str(kind)] = {
            "unstable": unstable,
            "sync_runs": sync_n,
            "sync_alarms": sync_alarms,
            "stable_async_runs": stable_n,
            "stable_async_alarms": stable_alarms,
        }
    return out


# ------------------------------------------------------------------------------- markdown
def _f(x: float, d: int = 3) -> str:
    return "—" if not math.isfinite(x) else f"{x:+.{d}f}"


def _comparisons(
    per_run: Mapping[str, Any],
    runs: Sequence[RunData],
    cells: Sequence[tuple[str, int, bool]] | None,
    staleness: int,
    *,
    replay: bool,
    quiet_load: float = math.inf,
) -> list[str]:
    """The equivalence table, compis − none, the speedups (also over the seeds whose runs kept
    the load at or below `quiet_load`) and the length bias of one phase."""
    lines = [
        "",
        f"Equivalence to sync (final held-out pass rate, margin ±{MARGIN}, TOST at 0.05):",
        "",
        "| cell | pairs | mean | 90% interval | equivalent |",
        "|---|---|---|---|---|",
    ]
    for row in equivalence_rows(per_run, cells, sync=group_of("sync", 0, replay=replay)):
        if row["n"] < 2:
            lines.append(f"| `{row['cell']}` | {row['n']} | — | — | not enough pairs |")
            continue
        eq = "**yes**" if row["equivalent"] else "not shown"
        lines.append(
            f"| `{row['cell']}` | {row['n']} | {_f(row['mean'])} | "
            f"[{_f(row['low'])}, {_f(row['high'])}] | {eq} |"
        )
    n, m, h = compis_vs_none(per_run, staleness, replay=replay)
    lines += ["", f"CompIS − none at S = {staleness}: {_f(m)} ± {_f(h)} (95%, {n} pairs)."]
    for arm in ("compis", "none"):
        sp = speedups(per_run, arm, staleness, replay=replay)
        if sp:
            med = statistics.median(x for _, x in sp)
            lines.append(
                f"Speedup sync wall / {arm} S = {staleness} wall: median {med:.2f}× over "
                f"{len(sp)} seeds (per seed: {', '.join(f'{x:.2f}' for _, x in sp)})."
            )
        if sp and math.isfinite(quiet_load):
            q = speedups(per_run, arm, staleness, replay=replay, max_load=quiet_load)
            each = ", ".join(f"seed {s} {x:.2f}" for s, x in q) or "none"
            lines.append(
                f"Of those, the seeds whose two runs each kept the node's mean load ≤ "
                f"{quiet_load:g}: {each}."
            )
    lines += ["", "Length bias of the staleness drop (final `length/trained_bias`):", ""]
    for g, vs in sorted(length_bias(runs).items()):
        mm, hh = mean_ci(vs)
        lines.append(f"* `{g}`: {_f(mm, 4)} ± {_f(hh, 4)} ({len(vs)} runs)")
    return lines


def render_phase3(
    *,
    staleness: int,
    per_run: Mapping[str, Any],
    runs: Sequence[RunData],
    planned: int,
    rules: VerdictRules,
    quiet_load: float = math.inf,
) -> str:
    """Phase 3's results as markdown: its staleness, the equivalence table, compis − none,
    the speedups (also over quiet pairs: `quiet_load`), the length bias, every run, and the
    early-warning guards on its runs."""
    cells = [(arm, staleness, False) for arm in ("compis", "none", "tis", "is")]
    lines = [
        f"## Phase 3: workload S (SmolLM2-135M) at S = {staleness}",
        "",
        f"{len(runs)} of {planned} planned runs finished.",
    ]
    lines += _comparisons(per_run, runs, cells, staleness, replay=False, quiet_load=quiet_load)
    judged = [(r.cell.name, r, per_run[r.cell.name]["verdict"]) for r in runs]
    warn = _early_warning_table(judged, rules, "Early warning over phase 3's runs")
    return "\n".join(lines + _every_run(per_run) + warn) + "\n"


def _every_run(per_run: Mapping[str, Any]) -> list[str]:
    """One row per finished run: verdict, the baseline and final held-out pass rates, wall,
    the node's mean load over the run ("—": not known)."""
    lines = [
        "",
        "| run | verdict | baseline eval | final eval | wall s | mean load |",
        "|---|---|---|---|---|---|",
    ]
    for n, r in sorted(per_run.items()):
        load = r.get("load", math.nan)
        lines.append(
            f"| `{n}` | {r['verdict']} | {r.get('eval_first', math.nan):.3f} | "
            f"{r['eval_final']:.3f} | {r['wall_s']:.0f} | "
            f"{f'{load:.1f}' if math.isfinite(load) else '—'} |"
        )
    return lines


def render_protocol(
    *,
    outcomes: Sequence[RegimeOutcome],
    choice: tuple[str, bool] | None,
    search_runs: Mapping[str, Mapping[str, Any]],
    confirm_per_run: Mapping[str, Any],
    confirm_runs: Sequence[RunData],
    planned: int,
    judged: Sequence[tuple[str, RunData, str]],
    rules: VerdictRules,
) -> str:
    """The protocol's results as markdown: the search, the choice, the equivalence table,
    compis − none, speedups, length bias, early warning, and every run."""
    lines = ["## Phase 1: the search", ""]
    lines += [
        "| regime | sync stable | none − sync (mean over seeds) | none unstable | breaks |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.regime} | {o.sync_stable} | {_f(o.none_minus_sync)} | {o.none_unstable} | "
            f"{o.breaks} |"
        )
    if choice:
        lines += [
            "",
            f"Confirmatory regime: **{choice[0]}** (the uncorrected arm broke: {choice[1]}).",
        ]
    lines += [
        "",
        "| regime | run | verdict | baseline eval | final eval | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for regime, per_run in search_runs.items():
        for n, r in sorted(per_run.items()):
            lines.append(
                f"| {regime} | `{n}` | {r['verdict']} | {r.get('eval_first', math.nan):.3f} | "
                f"{r['eval_final']:.3f} | {r['wall_s']:.0f} |"
            )
    lines += ["", "## Phase 2: confirmatory runs", ""]
    lines.append(f"{len(confirm_runs)} of {planned} planned runs finished.")
    lines += _comparisons(confirm_per_run, confirm_runs, None, PRIMARY_STALENESS, replay=True)
    lines += _every_run(confirm_per_run)
    intro = "Early warning over every run of both phases"
    return "\n".join(lines + _early_warning_table(judged, rules, intro)) + "\n"


def _early_warning_table(
    judged: Sequence[tuple[str, RunData, str]], rules: VerdictRules, intro: str
) -> list[str]:
    """Each early-warning guard at each setting the calibration tries, over `judged`."""
    lines = [
        "",
        f"{intro}, at each setting the calibration tries (lead = onset − first alarm, in "
        "steps; ahead = lead ≥ 0):",
        "",
        "| guard | setting | ahead of unstable runs | fired late | leads | alarms on sync runs "
        "| alarms on stable async runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in EARLY_WARNING:
        field, values = GUARD_SWEEP[str(kind)]
        for value in values:
            ew = early_warning(judged, rules, {field: value})[str(kind)]
            leads = [u["lead"] for u in ew["unstable"] if u["lead"] is not None]
            lines.append(
                f"| `{kind}` | {field}={value:g} | {sum(x >= 0 for x in leads)} of "
                f"{len(ew['unstable'])} | {sum(x < 0 for x in leads)} | {sorted(leads)} | "
                f"{ew['sync_alarms']} of {ew['sync_runs']} | "
                f"{ew['stable_async_alarms']} of {ew['stable_async_runs']} |"
            )
    return lines
