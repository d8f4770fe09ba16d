"""The stability lab's grid and what it computes over finished runs.

Owns what one run of the lab is (`Cell`: staleness, loss, routing replay, steps per rollout,
seed; `Budget`: what every run shares; `LOSSES`: what each loss name means as train_async.py
flags; `train_args`: the run's command line), how a finished run is recognised and read back
(`is_done`, which refuses mixing budgets; `RunData`, `load_runs`), and the analysis: per-run
summaries and verdicts (`slime_async.metrics.stability`'s rules), per-cell aggregates,
seed-paired differences (`paired`), the pooled async − sync (`pooled_vs_sync`) and routing
replay (`replay_effect`) statistics, the divergence guards' hit rates (`calibrate`) and the
rule that picks a guard's default from a calibration sweep (`choose_setting`).
Pure over files: running the grid is `scripts/bench_stability.py`, rendering the figure and
the markdown is `lab.report`, the goals checked are `lab.goals`. May import `slime_async`;
`slime_async` must never import it. See docs/stability.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slime_async.metrics import GuardConfig, GuardKind, read_metrics
from slime_async.metrics.guards import (
    saved_data_worker,
    saved_run_guard_config,
    staleness_fill_steps,
)
from slime_async.metrics.stability import (
    Verdict,
    VerdictRules,
    cell_verdict,
    guard_hits,
    mean_ci,
    summarize,
    verdict,
)

LOSSES: dict[str, tuple[str, ...]] = {
    "ppo": ("--loss", "ppo"),
    "decoupled_ppo": ("--loss", "decoupled_ppo"),
    "tis": ("--loss", "single_ratio"),  # token-level truncated IS, clip(π_k/π_SGL, 0, 2)
    "is": ("--loss", "single_ratio", "--loss-config", "method=none"),  # unclipped π_k/π_SGL
    "icepop": ("--loss", "single_ratio", "--loss-config", "method=icepop", "low=0.5", "high=2.0"),
    "compis": ("--loss", "compis", "--keep-old-actor"),
}
"""Grid name of a loss -> its train_async.py flags. `compis` is the method with its true π_j
(snapshots; the default of the embedded run, not of an `--hf-checkpoint` run, where CompIS
would fall back to the combined ratio, a single-ratio correction like `decoupled_ppo`'s)."""


RESULT = "result.json"
"""Written in a run directory once its run finished; its presence makes a resume skip it."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Cell:
    """One run of the grid: a cell (staleness, loss, replay, steps per rollout) and a seed."""

    staleness: int
    loss: str
    replay: bool
    nspr: int
    seed: int

    @property
    def group(self) -> str:
        """The cell's name without the seed (what the table has one row for)."""
        return f"s{self.staleness}-{self.loss}-rr{'on' if self.replay else 'off'}-n{self.nspr}"

    @property
    def name(self) -> str:
        """The run's name and directory: the cell and the seed."""
        return f"{self.group}-seed{self.seed}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    """What every run shares: the sample budget, the eval and the extra flags."""

    num_rollout: int
    eval_interval: int
    eval_prompts: int
    eval_samples: int
    warmstart_steps: int | None
    extra: tuple[str, ...] = ()


def grid(
    staleness: Sequence[int],
    losses: Sequence[str],
    replay: Sequence[str],
    nspr: Sequence[int],
    seeds: Sequence[int],
) -> list[Cell]:
    """Every combination, seeds innermost-last so a partial grid has whole cells first."""
    for name in losses:
        if name not in LOSSES:
            raise ValueError(f"unknown loss {name!r}; choose from {', '.join(LOSSES)}")
    for r in replay:
        if r not in ("on", "off"):
            raise ValueError(f"--replay takes on/off, got {r!r}")
    return [
        Cell(staleness=s, loss=lo, replay=r == "on", nspr=n, seed=seed)
        for seed, s, lo, r, n in itertools.product(seeds, staleness, losses, replay, nspr)
    ]


def select(cells: Sequence[Cell], patterns: str | None) -> list[Cell]:
    """Cells whose run name matches any comma-separated fnmatch pattern (all when None)."""
    if not patterns:
        return list(cells)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [c for c in cells if any(fnmatch.fnmatch(c.name, p) for p in pats)]


def train_args(
    cell: Cell, budget: Budget, run_dir: Path, cores: tuple[int, int] | None
) -> list[str]:
    """The train_async.py command line of one run."""
    args = [
        "--run-dir",
        str(run_dir),
        "--seed",
        str(cell.seed),
        "--max-staleness",
        str(cell.staleness),
        "--num-steps-per-rollout",
        str(cell.nspr),
        "--num-steps",
        str(budget.num_rollout * cell.nspr),  # = --num-rollout, and wins over
        # a recipe's num-steps (--config), which --num-rollout would conflict with
        "--routing-replay",
        "r3" if cell.replay else "none",
        "--eval-interval",
        str(budget.eval_interval),
        "--eval-prompts",
        str(budget.eval_prompts),
        "--n-samples-per-eval-prompt",
        str(budget.eval_samples),
        *LOSSES[cell.loss],
    ]
    if budget.warmstart_steps is not None:
        args += ["--warmstart-steps", str(budget.warmstart_steps)]
    if cores is not None:
        args += ["--trainer-cores", str(cores[0]), "--rollout-cores", str(cores[1])]
    return args + list(budget.extra)


def budget_record(budget: Budget) -> dict[str, Any]:
    """What result.json records of the budget a run had (JSON-comparable)."""
    return {**dataclasses.asdict(budget), "extra": list(budget.extra)}


class BudgetMismatch(RuntimeError):
    """A finished run in `--out` had another budget than the one asked for."""


def is_done(run_dir: Path, budget: Budget | None = None) -> bool:
    """The run finished (its result.json says so) with this budget (None: with any).

    A run that finished with another budget (rollouts, eval, warm start, extra flags) is never
    re-run over, nor mixed into this budget's report: that raises `BudgetMismatch`, naming both
    budgets and the fix."""
    try:
        res = json.loads((run_dir / RESULT).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if res.get("status") != "ok":
        return False
    if budget is None:
        return True
    had, want = res.get("budget"), budget_record(budget)
    if had != want:
        raise BudgetMismatch(
            f"{run_dir} finished with budget {had} (None: recorded before budgets were), but "
            f"this grid asks for {want}. Runs of different budgets are not comparable: give "
            f"another --out, or the flags that budget was run with (--num-rollout, "
            f"--eval-interval, --eval-prompts, --eval-samples, --warmstart-steps, -- extra)."
        )
    return True


# ---------------------------------------------------------------------------------- reading back
SOURCES = ("combined", "staleness", "engine", "drift")
"""IS ratio sources in the diagnostics (compis_metrics): π_k/π_SGL, r3, r2, r1."""


@dataclasses.dataclass(kw_only=True, slots=True)
class RunData:
    """One finished run, read back."""

    cell: Cell
    records: list[dict[str, Any]]
    gbs: int
    wall_s: float
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The run's config.json (what it actually ran with)."""
    load: float = math.nan
    """Mean 1-minute load average of the node over the run (`node_load`; NaN: not known)."""

    def budget(self) -> str:
        """Rollouts, samples and eval size this run had, from its config.json."""
        ro = self.config.get("rollout", {})
        nspr = ro.get("num_steps_per_rollout", 1)
        steps = self.config.get("num_steps", 0)
        return (
            f"{steps // max(1, nspr)} rollouts = {steps * self.gbs} samples; eval every "
            f"{ro.get('eval_interval')} rollouts on {ro.get('eval_prompts')} prompts × "
            f"{ro.get('n_samples_per_eval_prompt', 1)} samples"
        )

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(samples trained, values) where `key` is a finite number."""
        xs, ys = [], []
        for r in self.records:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(r["step"] * self.gbs)
                ys.append(float(v))
        return xs, ys

    def last(self, key: str) -> float:
        """The last finite value of `key` (NaN if none)."""
        _, ys = self.series(key)
        return ys[-1] if ys else math.nan

    def first(self, key: str) -> float:
        """The first finite value of `key` (NaN if none)."""
        _, ys = self.series(key)
        return ys[0] if ys else math.nan


def node_load(
    records: Sequence[Mapping[str, Any]], log: Sequence[tuple[float, float]] = ()
) -> float:
    """Mean 1-minute load average over a run: its own `timing/node_load_1m` (logged each step)
    where it has them, else the samples of `log` ((unix time, load) pairs, e.g. a
    `cut -d' ' -f1 /proc/loadavg` every 30 s) between its first and last record's `time`.
    NaN when neither says.

    >>> node_load([{"time": 10.0}, {"time": 70.0}], [(0.0, 9.0), (40.0, 3.0), (60.0, 5.0)])
    4.0
    """
    own = [r["timing/node_load_1m"] for r in records if "timing/node_load_1m" in r]
    if own:
        return sum(own) / len(own)
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    if not times or not log:
        return math.nan
    inside = [v for t, v in log if min(times) <= t <= max(times)]
    return sum(inside) / len(inside) if inside else math.nan


def read_load_log(path: Path | None) -> list[tuple[float, float]]:
    """`node_load`'s log: lines of unix time and 1-minute load average (more columns ignored)."""
    if path is None:
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            rows.append((float(parts[0]), float(parts[1])))
    return rows


def load_runs(
    out: Path,
    cells: Sequence[Cell],
    budget: Budget | None = None,
    *,
    load_log: Sequence[tuple[float, float]] = (),
) -> list[RunData]:
    """The finished runs among `cells` with `budget` (None: any); failed or missing ones are
    left out. `load_log`: for runs that did not log their node's load (`node_load`)."""
    runs = []
    for c in cells:
        d = out / "runs" / c.name
        if not is_done(d, budget):
            continue
        cfg = json.loads((d / "config.json").read_text())
        gbs = _find(cfg, "global_batch_size") or 1
        res = json.loads((d / RESULT).read_text())
        records = read_metrics(d / "metrics.jsonl").records
        runs.append(
            RunData(
                cell=c,
                records=records,
                gbs=int(gbs),
                wall_s=float(res["wall_s"]),
                config=cfg,
                load=node_load(records, load_log),
            )
        )
    return runs


def _find(obj: Any, key: str) -> Any:
    """The first value of `key` anywhere in a nested dict (config.json is nested by component)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            if (found := _find(v, key)) is not None:
                return found
    return None


# ---------------------------------------------------------------------------------- analysis
def analyse(runs: Sequence[RunData], rules: VerdictRules) -> dict[str, Any]:
    """Per-run summaries and verdicts, per-cell aggregates, goal checks, guard calibration."""
    per_run: dict[str, Any] = {}
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        s = summarize(r.records, rules, fill_steps=fill_steps(r))
        v, why = verdict(s, rules)
        per_run[r.cell.name] = {
            "group": r.cell.group,
            "verdict": str(v),
            "why": why,
            "gap_ratio": s.gap_ratio,
            "gap_start": s.gap_start,
            "gap_end": s.gap_end,
            "reward_start": s.reward_start,
            "reward_peak": s.reward_peak,
            "reward_end": s.reward_end,
            "eval_final": r.last("eval/reward"),
            "eval_first": r.first("eval/reward"),
            "eval_se": r.last("eval/reward_se"),
            "staleness_mean": _mean_of(r, "staleness/mean"),
            "staleness_max": max(r.series("staleness/max")[1], default=math.nan),
            "engine_gap": _mean_of(r, "mismatch/engine_logprob_abs_diff"),
            "is_p99": {src: _mean_of(r, f"is/{src}/p99") for src in SOURCES},
            "clipped_frac": {src: _mean_of(r, f"is/{src}/clipped_frac") for src in SOURCES},
            "ppo_clipfrac": _mean_of(r, "policy/clipfrac"),
            "guards": sorted(guard_hits(r.records, run_guards(r))),
            "wall_s": r.wall_s,
            "load": r.load,
        }
        groups.setdefault(r.cell.group, []).append(r)
    cells: dict[str, Any] = {}
    for g, rs in groups.items():
        rows = [per_run[r.cell.name] for r in rs]
        v, counts = cell_verdict([Verdict(x["verdict"]) for x in rows])
        agg = {
            k: mean_ci([x[k] for x in rows])
            for k in (
                "reward_end",
                "eval_final",
                "gap_start",
                "gap_end",
                "gap_ratio",
                "staleness_mean",
                "staleness_max",
                "wall_s",
                "engine_gap",
                "ppo_clipfrac",
            )
        }
        for part in ("is_p99", "clipped_frac"):
            for src in SOURCES:
                agg[f"{part}/{src}"] = mean_ci([x[part][src] for x in rows])
        agg["eval_se"] = (max(x["eval_se"] for x in rows), math.nan)
        cells[g] = {
            "verdict": str(v),
            "counts": counts,
            "seeds": len(rs),
            **{k: list(val) for k, val in agg.items()},
        }
    for g, c in cells.items():
        st, loss, rr, n = split_group(g)
        c["vs_sync"] = paired(per_run, g, f"s0-{loss}-{rr}-{n}") if st else None
        c["vs_ppo"] = paired(per_run, g, f"s{st}-ppo-{rr}-{n}") if loss != "ppo" else None
        c["vs_rron"] = paired(per_run, g, f"s{st}-{loss}-rron-{n}") if rr == "rroff" else None
    return {
        "runs": per_run,
        "cells": cells,
        "guards": calibrate(runs, per_run),
        "replay": replay_effect(per_run),
        "vs_sync": pooled_vs_sync(per_run),
        "rules": dataclasses.asdict(rules),
    }


def pooled_vs_sync(per_run: dict[str, Any]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """loss -> staleness -> key -> [mean, 95% t half-width, pairs]: each async run minus the
    synchronous run of the same loss, routing replay, steps per rollout and seed, pooled over
    those (a cell of the full grid holds 3 pairs; pooled, 12), for the final eval, the end
    train reward and the end gap."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    diffs: dict[tuple[str, int, str], list[float]] = {}
    for name, r in per_run.items():
        st, loss, _, _ = split_group(r["group"])
        sync = per_run.get(name.replace(f"s{st}-", "s0-", 1)) if st else None
        if sync is None:
            continue
        for key in ("eval_final", "reward_end", "gap_end"):
            d = r[key] - sync[key]
            if math.isfinite(d):
                diffs.setdefault((loss, st, key), []).append(d)
    for (loss, st, key), ds in sorted(diffs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        m, h = mean_ci(ds)
        out.setdefault(loss, {}).setdefault(f"s{st}", {})[key] = [m, h, float(len(ds))]
    return out


def replay_effect(per_run: dict[str, Any]) -> dict[str, Any]:
    """Routing replay's change of the train–rollout gap (end window) and of the engine gap,
    pooled over every seed-paired (R3 on, R3 off) pair of runs of the same staleness, loss and
    steps per rollout: the geometric mean ratio on/off − 1 with its 95% t-interval, over all
    pairs and per staleness. One cell holds one to three pairs, too few to see the goal
    (`lab.goals.Goals.replay_change`, Relax's −38%) through this noise; the grid holds up
    to 60."""

    def pooled(pairs: list[tuple[float, float]]) -> list[float]:
        logs = [
            math.log(on / off)
            for on, off in pairs
            if on > 0 and off > 0 and math.isfinite(on) and math.isfinite(off)
        ]
        if not logs:
            return [math.nan, math.nan, math.nan, 0.0]
        m, h = mean_ci(logs)
        h = 0.0 if math.isnan(h) else h
        return [math.exp(m) - 1, math.exp(m - h) - 1, math.exp(m + h) - 1, float(len(logs))]

    out: dict[str, Any] = {}
    for key in ("gap_end", "engine_gap"):
        pairs: dict[str, list[tuple[float, float]]] = {"all": []}
        for name, off in per_run.items():
            if "-rroff-" not in name:
                continue
            on = per_run.get(name.replace("-rroff-", "-rron-"))
            if on is None:
                continue
            pair = (on[key], off[key])
            pairs["all"].append(pair)
            pairs.setdefault(f"s{split_group(off['group'])[0]}", []).append(pair)
        out[key] = {k: pooled(v) for k, v in sorted(pairs.items(), key=lambda kv: _by_s(kv[0]))}
    return out


def _by_s(k: str) -> tuple[int, int]:
    return (0, 0) if k == "all" else (1, int(k[1:]))


def paired(per_run: dict[str, Any], group: str, other: str) -> dict[str, list[float]] | None:
    """Seed-paired differences `group − other` (same seed: same warm start, eval set and
    prompt order) of the final eval, end train reward and gaps, mean ± 95% t half-width; None
    when no seed ran in both."""
    seeds = {n.rsplit("-seed", 1)[1] for n, r in per_run.items() if r["group"] == group}
    both = sorted(x for x in seeds if f"{other}-seed{x}" in per_run)
    if not both:
        return None
    out: dict[str, list[float]] = {"seeds": [float(len(both)), math.nan]}
    for key in ("eval_final", "reward_end", "gap_end", "engine_gap"):
        diffs = [per_run[f"{group}-seed{x}"][key] - per_run[f"{other}-seed{x}"][key] for x in both]
        out[key] = list(mean_ci(diffs))
    return out


def _mean_of(r: RunData, key: str) -> float:
    _, ys = r.series(key)
    return sum(ys) / len(ys) if ys else math.nan


def fill_steps(r: RunData) -> int:
    """Steps until the run's staleness budget filled: its bound `S + ceil((W - 1) / B)`."""
    dw = saved_data_worker(r.config)
    return 0 if dw is None else staleness_fill_steps(dw)


def run_guards(r: RunData) -> GuardConfig:
    """The guards as the run applied them live: defaults, with the log-prob-gap baseline taken
    once its staleness settled (`guards.saved_run_guard_config` of its config.json)."""
    return saved_run_guard_config(r.config)


GUARD_SWEEP: dict[str, tuple[str, tuple[float, ...]]] = {
    str(GuardKind.LOGPROB_DIFF_DRIFT): ("diff_factor", (3.0, 4.0, 5.0)),
    str(GuardKind.ENTROPY_SPIKE): ("entropy_factor", (1.5, 2.0, 3.0)),
    str(GuardKind.IS_WEIGHT_RANGE): ("is_upper", (1.1, 1.25, 1.5)),
    str(GuardKind.ROLLOUT_LOGPROB_TREND): ("trend_min_drop", (0.35, 0.4, 0.5)),
    str(GuardKind.IS_ESS_LOW): ("ess_floor", (0.3, 0.5, 0.7)),
    str(GuardKind.GRAD_COSINE_LOW): ("grad_cosine_floor", (-0.2, -0.1, 0.0)),
}
"""Each guard's main threshold and the values the calibration tries (the default among them)."""


def _hits(r: RunData, field: str, value: float) -> set[str]:
    """The guards that fire on run `r` with `field` of its guard settings set to `value`."""
    return guard_hits(r.records, dataclasses.replace(run_guards(r), **{field: value}))


def calibrate(runs: Sequence[RunData], per_run: dict[str, Any]) -> dict[str, Any]:
    """Each guard's hit rate on unstable (drifting/collapsed) vs stable runs, at each value of
    its main threshold in GUARD_SWEEP (the others at their defaults)."""
    unstable = [r for r in runs if per_run[r.cell.name]["verdict"] != Verdict.STABLE]
    stable = [r for r in runs if per_run[r.cell.name]["verdict"] == Verdict.STABLE]
    out: dict[str, Any] = {"n_unstable": len(unstable), "n_stable": len(stable), "sweep": {}}
    default = GuardConfig()
    for kind, (field, values) in GUARD_SWEEP.items():
        rows = []
        for value in values:
            hit_u, hit_s = (
                sum(kind in _hits(r, field, value) for r in group) for group in (unstable, stable)
            )
            rows.append(
                {
                    "value": value,
                    "default": value == getattr(default, field),
                    "unstable_hits": hit_u,
                    "stable_hits": hit_s,
                }
            )
        out["sweep"][kind] = {"field": field, "rows": rows}
    return out


MAX_FALSE_ALARMS = 1 / 3
"""Largest share of the stable runs a guard's default may fire on."""


def choose_setting(
    rows: Sequence[tuple[Any, int, int]], n_unstable: int, n_stable: int
) -> tuple[Any, int, int] | None:
    """The default a guard's calibration picks from its sweep's `(setting, unstable hits,
    stable hits)` rows: among the settings firing on at most `MAX_FALSE_ALARMS` of the stable
    runs, those whose separation (share of unstable runs hit minus share of stable runs hit)
    is within one unstable run (1 / n_unstable) of the best, and of those the one firing on
    the fewest stable runs. A difference smaller than one unstable run is not evidence; a
    false alarm on a healthy run is what gets a guard ignored. None when no setting qualifies."""

    def score(row: tuple[Any, int, int]) -> float:
        return row[1] / max(1, n_unstable) - row[2] / max(1, n_stable)

    ok = [r for r in rows if r[2] <= MAX_FALSE_ALARMS * n_stable]
    if not ok:
        return None
    best = max(score(r) for r in ok)
    near = [r for r in ok if score(r) >= best - 1 / max(1, n_unstable) - 1e-12]
    return min(near, key=lambda r: (r[2], -score(r)))


def split_group(g: str) -> tuple[int, str, str, str]:
    """A cell's name `s<S>-<loss>-rr<on|off>-n<N>` -> (S, loss, "rron"/"rroff", "n<N>")."""
    parts = g.split("-")
    return int(parts[0][1:]), "-".join(parts[1:-2]), parts[-2], parts[-1]


def group_key(g: str) -> tuple:
    """Sort key of a cell or run name: staleness, then the loss in `LOSSES` order."""
    s, loss, _, _ = split_group(g.rsplit("-seed", 1)[0])
    return (s, list(LOSSES).index(loss) if loss in LOSSES else 99, g)
