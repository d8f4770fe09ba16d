"""Stability lab: does async RL drift here without correction, and does CompIS hold?

Runs the real `train_async.py` once per grid cell and seed (a subprocess with its own run
directory under `--out`), over staleness (`--max-staleness`; 0 is synchronous training), loss
(`ppo` with no behaviour weight, `decoupled_ppo`, `tis` = the registered `single_ratio` loss,
one truncated IS weight on π_k/π_SGL, and `compis`), rollout routing replay on/off and
`--num-steps-per-rollout` (1: r1 ≡ 1, the drift term idle; 4: four optimizer steps per rollout),
at an equal sample budget (`--num-rollout` rollouts of the same size for every cell). Then it
reads each run's `metrics.jsonl` and writes, under `--out`:

* `stability.png`: rows = train reward, eval reward, train–rollout log-prob gap, entropy, IS
  p99 of each source (staleness r3, engine r2, drift r1), grad norm, over samples trained;
  columns = (staleness, steps per rollout); one line per (loss, replay), mean ± one standard
  deviation over seeds (curves smoothed over `--smooth` of the steps). The per-source split
  (r2/r3) needs π_j^Meg, which only `compis` reads; the other losses show the combined ratio;
* `stability.md`: the table of final values (mean ± 95% t-interval over seeds), the verdict
  of every run and cell (`slime_async.metrics.stability`: stable / drifting / collapsed), the
  issue's goal checks and the divergence guards' hit rates on unstable vs stable runs;
* `summary.json`: the same numbers, machine-readable.

Resumable: a run whose `result.json` says it finished is skipped (`--report-only` skips all
running); a half-done run directory is wiped and re-run. Runs go `--jobs` at a time; with
enough cores each job gets its own trainer/rollout core pair. The warm start (the default
run's supervised phase) is trained once per seed and copied into each run directory, where
`train_async.py` finds it by hash and reuses it.

    .venv/bin/python scripts/bench_stability.py --quick                  # quick grid
    .venv/bin/python scripts/bench_stability.py --out runs/stab --jobs 2 # full grid
    .venv/bin/python scripts/bench_stability.py --quick --cells 's16-*'  # a subset
    .venv/bin/python scripts/bench_stability.py --quick -- --lr 3e-4     # extra train flags
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import fnmatch
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree

from slime_async.metrics import GuardConfig, GuardKind, read_metrics  # noqa: E402
from slime_async.metrics.guards import run_guard_config, staleness_fill_steps  # noqa: E402
from slime_async.metrics.stability import (  # noqa: E402
    GAP_KEY,
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
    "icepop": ("--loss", "single_ratio", "--loss-config", "method=icepop", "low=0.5", "high=2.0"),
    "compis": ("--loss", "compis", "--keep-old-actor"),
}
"""Grid name of a loss -> its train_async.py flags. `compis` is the method with its true π_j
(snapshots; the default of the embedded run, not of an `--hf-checkpoint` run, where CompIS
would fall back to the combined ratio, a single-ratio correction like `decoupled_ppo`'s)."""
RESULT = "result.json"
"""Written in a run directory once its run finished; its presence makes a resume skip it."""

FULL = dict(staleness=(0, 1, 4, 8, 16), losses=("ppo", "decoupled_ppo", "tis", "compis"),
            replay=("on", "off"), nspr=(1, 4), seeds=(1, 2, 3), num_rollout=50,
            eval_interval=10)  # fmt: skip
"""The issue's grid: every axis, at the quick form's budget (so the quick runs are its runs;
240 runs of 50 rollouts are ~5 hours on 2 cores, of 200 rollouts ~27; `--num-rollout 200`)."""
QUICK = dict(staleness=(0, 16), losses=("ppo", "compis"), replay=("on",), nspr=(4,),
             seeds=(1, 2, 3), num_rollout=50, eval_interval=10)  # fmt: skip


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


def grid(staleness: Sequence[int], losses: Sequence[str], replay: Sequence[str],
         nspr: Sequence[int], seeds: Sequence[int]) -> list[Cell]:  # fmt: skip
    """Every combination, seeds innermost-last so a partial grid has whole cells first."""
    for name in losses:
        if name not in LOSSES:
            raise ValueError(f"unknown loss {name!r}; choose from {', '.join(LOSSES)}")
    for r in replay:
        if r not in ("on", "off"):
            raise ValueError(f"--replay takes on/off, got {r!r}")
    return [Cell(staleness=s, loss=lo, replay=r == "on", nspr=n, seed=seed)
            for seed, s, lo, r, n in itertools.product(seeds, staleness, losses, replay, nspr)]  # fmt: skip


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
        "--run-dir", str(run_dir), "--seed", str(cell.seed),
        "--max-staleness", str(cell.staleness), "--num-steps-per-rollout", str(cell.nspr),
        "--num-steps", str(budget.num_rollout * cell.nspr),  # = --num-rollout, and wins over
        # a recipe's num-steps (--config), which --num-rollout would conflict with
        "--routing-replay", "r3" if cell.replay else "none",
        "--eval-interval", str(budget.eval_interval), "--eval-prompts", str(budget.eval_prompts),
        "--n-samples-per-eval-prompt", str(budget.eval_samples),
        *LOSSES[cell.loss],
    ]  # fmt: skip
    if budget.warmstart_steps is not None:
        args += ["--warmstart-steps", str(budget.warmstart_steps)]
    if cores is not None:
        args += ["--trainer-cores", str(cores[0]), "--rollout-cores", str(cores[1])]
    return args + list(budget.extra)


# ---------------------------------------------------------------------------------- running
def prepare_warmstart(out: Path, seed: int, steps: int | None) -> Path:
    """The warm-started model of `seed` under `out/warmstart/seed<seed>`, trained once, exactly
    as train_async.py would (same spec, task config and warm-start config, so its hash
    matches and the run reuses it)."""
    from slime_async.contracts.model import TINY_MOE
    from slime_async.rollout.tasks import TaskFamilyConfig
    from slime_async.rollout.warmstart import WarmStartConfig, warm_start
    from slime_async.run_config import run_default

    steps = run_default("warmstart_steps") if steps is None else steps
    res = warm_start(out / "warmstart" / f"seed{seed}", spec=TINY_MOE,
                     task=TaskFamilyConfig(seed=seed),
                     config=WarmStartConfig(max_steps=steps, seed=seed, num_threads=1),
                     say=lambda m: print(f"[warmstart seed {seed}] {m}", flush=True))  # fmt: skip
    return res.path


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


TIMED_OUT = 124
"""A run's return code when it was killed as stalled (as `timeout(1)` reports a timeout)."""
POLL_S = 2.0
"""How often `run_logged` looks at a run's progress."""


def run_logged(cmd: Sequence[str], log: Any, *, env: dict[str, str], progress: Sequence[Path],
               stall_s: float | None) -> int:  # fmt: skip
    """Run `cmd` (in its own process group, output to `log`) and return its exit code. A run
    whose progress file (the first of `progress` that exists: its metrics.jsonl, else its log)
    has not changed for `stall_s` is hung: the whole group (the run's Ray node and actors too)
    is killed and the code is `TIMED_OUT`, so one hung run never stalls the grid, while a slow
    one (a real model's step can take minutes) runs as long as it moves."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    last, mark = time.monotonic(), None
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        state = next(((p, p.stat().st_mtime_ns, p.stat().st_size)
                      for p in progress if p.exists()), None)  # fmt: skip
        if state != mark:
            last, mark = now, state
        if stall_s is not None and now - last > stall_s:
            break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.seek(0, os.SEEK_END)  # after what the run wrote through the shared descriptor
    log.write(f"\n[bench_stability] killed: no progress for --stall-timeout {stall_s:.0f}s\n")
    return TIMED_OUT


def run_cell(cell: Cell, budget: Budget, out: Path, *, cores: tuple[int, int] | None,
             warmstart: Path | None, python: str,
             stall_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Run one cell to completion (or failure) and write its result.json."""
    run_dir = out / "runs" / cell.name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # half-done: start over (a finished one was skipped before)
    run_dir.mkdir(parents=True)
    if warmstart is not None:
        shutil.copytree(warmstart, run_dir / "warmstart")
    cmd = [python, str(ROOT / "train_async.py"), *train_args(cell, budget, run_dir, cores)]
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with (run_dir / "train.log").open("w") as log:
        rc = run_logged(cmd, log, env=env, stall_s=stall_s,
                        progress=(run_dir / "metrics.jsonl", run_dir / "train.log"))  # fmt: skip
    wall = time.monotonic() - t0
    steps = 0
    if (run_dir / "metrics.jsonl").exists():
        steps = max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl").records), default=0)
    expected = budget.num_rollout * cell.nspr
    status = "ok" if rc == 0 and steps >= expected else "failed"
    result = {"status": status, "cell": dataclasses.asdict(cell), "group": cell.group,
              "rc": rc, "steps": steps, "expected_steps": expected, "wall_s": round(wall, 1),
              "command": cmd[1:], "budget": budget_record(budget)}  # fmt: skip
    (run_dir / RESULT).write_text(json.dumps(result, indent=1))
    return result


def run_grid(cells: Sequence[Cell], budget: Budget, out: Path, *, jobs: int,
             stall_s: float | None = None) -> None:  # fmt: skip
    """Run the cells not done yet, `jobs` at a time; print one line per finished run."""
    todo = [c for c in cells if not is_done(out / "runs" / c.name, budget)]
    print(f"{len(cells) - len(todo)} of {len(cells)} runs already done; {len(todo)} to run "
          f"({jobs} at a time)", flush=True)  # fmt: skip
    if not todo:
        return
    own = ("--hf-checkpoint", "--prompt-data", "--prompt-source", "--load", "--config")
    embedded = not any(f in budget.extra for f in own)  # else no tiny-model warm start
    ws = {}
    if embedded and budget.warmstart_steps != 0:
        for seed in sorted({c.seed for c in todo}):
            ws[seed] = prepare_warmstart(out, seed, budget.warmstart_steps)
    usable = sorted(os.sched_getaffinity(0))
    pairs = ([(usable[2 * i], usable[2 * i + 1]) for i in range(jobs)]
             if jobs > 1 and len(usable) >= 2 * jobs else None)  # fmt: skip
    free = list(range(jobs))
    lock = threading.Lock()

    def one(cell: Cell) -> dict[str, Any]:
        with lock:
            slot = free.pop()
        try:
            return run_cell(cell, budget, out, cores=pairs[slot] if pairs else None,
                            warmstart=ws.get(cell.seed), python=sys.executable,
                            stall_s=stall_s)  # fmt: skip
        finally:
            with lock:
                free.append(slot)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(one, c): c for c in todo}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            c, res = futures[fut], fut.result()
            print(f"[{i}/{len(todo)}] {c.name}: {res['status']} (rc {res['rc']}, "
                  f"{res['steps']}/{res['expected_steps']} steps, {res['wall_s']:.0f}s; "
                  f"{time.monotonic() - t0:.0f}s elapsed)", flush=True)  # fmt: skip


# ---------------------------------------------------------------------------------- analysis
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

SOURCES = ("combined", "staleness", "engine", "drift")
"""IS ratio sources in the diagnostics (compis_metrics): π_k/π_SGL, r3, r2, r1."""

GUARD_SWEEP: dict[str, tuple[str, tuple[float, ...]]] = {
    str(GuardKind.LOGPROB_DIFF_DRIFT): ("diff_factor", (2.0, 3.0, 5.0)),
    str(GuardKind.ENTROPY_SPIKE): ("entropy_factor", (1.5, 2.0, 3.0)),
    str(GuardKind.IS_WEIGHT_RANGE): ("is_upper", (1.1, 1.25, 1.5)),
    str(GuardKind.ROLLOUT_LOGPROB_TREND): ("trend_min_drop", (0.25, 0.35, 0.5)),
}
"""Each guard's main threshold and the values the calibration tries (the default among them)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class RunData:
    """One finished run, read back."""

    cell: Cell
    records: list[dict[str, Any]]
    gbs: int
    wall_s: float
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The run's config.json (what it actually ran with)."""

    def budget(self) -> str:
        """Rollouts, samples and eval size this run had, from its config.json."""
        ro = self.config.get("rollout", {})
        nspr = ro.get("num_steps_per_rollout", 1)
        steps = self.config.get("num_steps", 0)
        return (f"{steps // max(1, nspr)} rollouts = {steps * self.gbs} samples; eval every "
                f"{ro.get('eval_interval')} rollouts on {ro.get('eval_prompts')} prompts × "
                f"{ro.get('n_samples_per_eval_prompt', 1)} samples")  # fmt: skip

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


def load_runs(out: Path, cells: Sequence[Cell], budget: Budget | None = None) -> list[RunData]:
    """The finished runs among `cells` with `budget` (None: any); failed or missing ones are
    left out."""
    runs = []
    for c in cells:
        d = out / "runs" / c.name
        if not is_done(d, budget):
            continue
        cfg = json.loads((d / "config.json").read_text())
        gbs = _find(cfg, "global_batch_size") or 1
        res = json.loads((d / RESULT).read_text())
        runs.append(RunData(cell=c, records=read_metrics(d / "metrics.jsonl").records,
                            gbs=int(gbs), wall_s=float(res["wall_s"]), config=cfg))  # fmt: skip
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


def _fmt(m: float, h: float, digits: int = 3) -> str:
    if not math.isfinite(m):
        return "–"
    return f"{m:.{digits}f} ± {h:.{digits}f}" if math.isfinite(h) else f"{m:.{digits}f}"


def analyse(runs: Sequence[RunData], rules: VerdictRules) -> dict[str, Any]:
    """Per-run summaries and verdicts, per-cell aggregates, goal checks, guard calibration."""
    per_run: dict[str, Any] = {}
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        s = summarize(r.records, rules, fill_steps=fill_steps(r))
        v, why = verdict(s, rules)
        per_run[r.cell.name] = {
            "group": r.cell.group, "verdict": str(v), "why": why, "gap_ratio": s.gap_ratio,
            "gap_start": s.gap_start, "gap_end": s.gap_end, "reward_start": s.reward_start,
            "reward_peak": s.reward_peak, "reward_end": s.reward_end,
            "eval_final": r.last("eval/reward"), "eval_se": r.last("eval/reward_se"),
            "staleness_mean": _mean_of(r, "staleness/mean"),
            "staleness_max": max(r.series("staleness/max")[1], default=math.nan),
            "engine_gap": _mean_of(r, "mismatch/engine_logprob_abs_diff"),
            "is_p99": {src: _mean_of(r, f"is/{src}/p99") for src in SOURCES},
            "clipped_frac": {src: _mean_of(r, f"is/{src}/clipped_frac") for src in SOURCES},
            "ppo_clipfrac": _mean_of(r, "policy/clipfrac"),
            "guards": sorted(guard_hits(r.records, run_guards(r))), "wall_s": r.wall_s,
        }  # fmt: skip
        groups.setdefault(r.cell.group, []).append(r)
    cells: dict[str, Any] = {}
    for g, rs in groups.items():
        rows = [per_run[r.cell.name] for r in rs]
        v, counts = cell_verdict([Verdict(x["verdict"]) for x in rows])
        agg = {k: mean_ci([x[k] for x in rows])
               for k in ("reward_end", "eval_final", "gap_start", "gap_end", "gap_ratio",
                         "staleness_mean", "staleness_max", "wall_s", "engine_gap",
                         "ppo_clipfrac")}  # fmt: skip
        for part in ("is_p99", "clipped_frac"):
            for src in SOURCES:
                agg[f"{part}/{src}"] = mean_ci([x[part][src] for x in rows])
        agg["eval_se"] = (max(x["eval_se"] for x in rows), math.nan)
        cells[g] = {"verdict": str(v), "counts": counts, "seeds": len(rs),
                    **{k: list(val) for k, val in agg.items()}}  # fmt: skip
    for g, c in cells.items():
        st, loss, rr, n = _parts(g)
        c["vs_sync"] = paired(per_run, g, f"s0-{loss}-{rr}-{n}") if st else None
        c["vs_ppo"] = paired(per_run, g, f"s{st}-ppo-{rr}-{n}") if loss != "ppo" else None
        c["vs_rron"] = paired(per_run, g, f"s{st}-{loss}-rron-{n}") if rr == "rroff" else None
    return {"runs": per_run, "cells": cells, "guards": calibrate(runs, per_run),
            "replay": replay_effect(per_run), "vs_sync": pooled_vs_sync(per_run),
            "rules": dataclasses.asdict(rules)}  # fmt: skip


def pooled_vs_sync(per_run: dict[str, Any]) -> dict[str, dict[str, dict[str, list[float]]]]:
    """loss -> staleness -> key -> [mean, 95% t half-width, pairs]: each async run minus the
    synchronous run of the same loss, routing replay, steps per rollout and seed, pooled over
    those (a cell of the full grid holds 3 pairs; pooled, 12), for the final eval, the end
    train reward and the end gap."""
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    diffs: dict[tuple[str, int, str], list[float]] = {}
    for name, r in per_run.items():
        st, loss, _, _ = _parts(r["group"])
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
    steps per rollout: the geometric mean ratio on/off − 1 with its 95% t-interval (a change
    of −38% is Relax's figure), over all pairs and per staleness. One cell holds one to three
    pairs, too few to see a −38% effect through this noise; the grid holds up to 60."""

    def pooled(pairs: list[tuple[float, float]]) -> list[float]:
        logs = [math.log(on / off) for on, off in pairs
                if on > 0 and off > 0 and math.isfinite(on) and math.isfinite(off)]  # fmt: skip
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
            pairs.setdefault(f"s{_parts(off['group'])[0]}", []).append(pair)
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
    return staleness_fill_steps(r.config.get("data_worker", {}))


def run_guards(r: RunData) -> GuardConfig:
    """The guards as the run applied them live: defaults, with the log-prob-gap baseline taken
    once its staleness budget filled (`staleness_fill_steps` of its config.json)."""
    return run_guard_config(r.config.get("data_worker", {}))


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
            rows.append({"value": value, "default": value == getattr(default, field),
                         "unstable_hits": hit_u, "stable_hits": hit_s})  # fmt: skip
        out["sweep"][kind] = {"field": field, "rows": rows}
    return out


# ---------------------------------------------------------------------------------- outputs
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
    colors = {"ppo": "tab:red", "decoupled_ppo": "tab:orange", "tis": "tab:purple",
              "icepop": "tab:brown", "compis": "tab:blue"}  # fmt: skip
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
                seeds = [r for r in runs if (r.cell.staleness, r.cell.nspr, r.cell.loss,
                                             r.cell.replay) == (s, n, loss, rr)]  # fmt: skip
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
                ys = np.array([_smooth([dict(zip(*c, strict=True))[x] for x in grid_x], w)
                               for c in curves])  # fmt: skip
                m, sd = ys.mean(0), ys.std(0)
                style = "-" if rr else "--"
                label = f"{loss}{'' if rr else ' (no R3)'} ×{len(curves)}"
                ax.plot(grid_x, m, style, color=colors[loss], lw=1.2, label=label,
                        marker="o" if key == "eval/reward" else None, ms=3)  # fmt: skip
                ax.fill_between(grid_x, m - sd, m + sd, color=colors[loss], alpha=0.15, lw=0)
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
    lines = [f"Command: `{command}`", "",
             f"Budget per run (from each run's config.json): {'; or '.join(budgets)}.", "",
             "| cell | seeds | verdict | final eval reward | eval SE (max) | end train reward "
             "| gap start | gap end | gap end/start | staleness mean | staleness max | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for g in sorted(an["cells"], key=_group_key):
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
    for g in sorted(an["cells"], key=_group_key):
        c = an["cells"][g]
        p99 = " | ".join(_fmt(*c[f"is_p99/{s}"], 3) for s in SOURCES)
        lines.append(
            f"| `{g}` | {_fmt(*c['engine_gap'], 4)} | {p99} "
            f"| {_fmt(*c['clipped_frac/staleness'], 4)} "
            f"| {_fmt(*c['clipped_frac/engine'], 4)} | {_fmt(*c['ppo_clipfrac'], 4)} |"
        )
    lines += ["", "Seed-paired differences (same seed = same warm start, eval prompts and prompt "
              "order; the seeds differ far more than the cells do):", "",
              "| cell | minus | seeds | Δ final eval | Δ end train reward | Δ gap end |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for g in sorted(an["cells"], key=_group_key):
        c = an["cells"][g]
        for key, label in (("vs_sync", "sync, same loss"), ("vs_ppo", "ppo, same staleness"),
                           ("vs_rron", "R3 on")):  # fmt: skip
            if d := c.get(key):
                lines.append(f"| `{g}` | {label} | {d['seeds'][0]:.0f} "
                             f"| {_fmt(*d['eval_final'])} | {_fmt(*d['reward_end'])} "
                             f"| {_fmt(*d['gap_end'], 4)} |")  # fmt: skip
    lines += pooled_table(an.get("vs_sync", {}))
    lines += ["",
              "Per run (verdict, the rule that decided it, guards that fired):", ""]  # fmt: skip
    for name in sorted(an["runs"], key=_group_key):
        r = an["runs"][name]
        lines.append(f"* `{name}`: **{r['verdict']}**: {r['why']}; guards: "
                     f"{', '.join(r['guards']) or 'none'}")  # fmt: skip
    lines += ["", *goal_checks(an), "", *guard_table(an["guards"])]
    return "\n".join(lines) + "\n"


def pooled_table(vs: dict[str, dict[str, dict[str, list[float]]]]) -> list[str]:
    """The pooled async − sync differences as one table per measure: loss × staleness."""
    if not vs:
        return []
    cols = sorted({st for by in vs.values() for st in by}, key=lambda k: int(k[1:]))
    out = ["", "Async minus sync, seed-paired and pooled over routing replay and steps per "
           "rollout (mean ± 95% t half-width, pairs):"]  # fmt: skip
    for key, what in (("reward_end", "end train reward"), ("eval_final", "final eval reward"),
                      ("gap_end", "train–rollout gap at the end")):  # fmt: skip
        out += ["", f"| {what} | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for loss in sorted(vs, key=lambda x: list(LOSSES).index(x) if x in LOSSES else 99):
            cells = []
            for st in cols:
                v = vs[loss].get(st, {}).get(key)
                cells.append("–" if v is None else
                             f"{_fmt(v[0], v[1], 4 if key == 'gap_end' else 3)} ({v[2]:.0f})")  # fmt: skip
            out.append(f"| `{loss}` | " + " | ".join(cells) + " |")
    return out


def _group_key(g: str) -> tuple:
    s, loss, _, _ = _parts(g.rsplit("-seed", 1)[0])
    return (s, list(LOSSES).index(loss) if loss in LOSSES else 99, g)


def goal_checks(an: dict[str, Any]) -> list[str]:
    """The issue's goals, checked on whatever cells ran."""
    cells = an["cells"]
    out = ["Goal checks (the issue's bars, on the cells that ran):", ""]
    top = max((int(g.split("-")[0][1:]) for g in cells), default=None)
    if top is None:
        out.append("* no cells")
    for g, c in sorted(cells.items()):
        s, loss, rr, n = _parts(g)
        if s != top:
            continue
        if loss == "ppo":
            ok = c["gap_ratio"][0] >= 2.0 or c["verdict"] != "stable"
            out.append(f"* `{g}` uncorrected PPO drifts (gap end/start ≥ 2 or reward falling): "
                       f"{'yes' if ok else 'no'} (gap end/start {_fmt(*c['gap_ratio'], 2)}, "
                       f"verdict {c['verdict']})")  # fmt: skip
        if loss == "compis":
            sync = cells.get(f"s0-compis-{rr}-{n}") if s else None
            flat = c["gap_ratio"][0] <= 1.2
            line = (f"* `{g}` CompIS flat (gap end/start ≤ 1.2): {'yes' if flat else 'no'} "
                    f"({_fmt(*c['gap_ratio'], 2)})")  # fmt: skip
            if sync is not None and c.get("vs_sync"):
                d, h = c["vs_sync"]["eval_final"]
                line += (f"; final eval within 0.05 of sync `s0-compis-{rr}-{n}`: "
                         f"{'yes' if abs(d) <= 0.05 else 'no'} (seed-paired difference "
                         f"{_fmt(d, h)}, {c['vs_sync']['seeds'][0]:.0f} seeds)")  # fmt: skip
            out.append(line)
    for g, c in sorted(cells.items()):
        s, loss, rr, n = _parts(g)
        if rr == "rroff" and (d := c.get("vs_rron")):
            k = d["seeds"][0]
            parts = []
            for key, what in (("gap_end", "train–rollout gap (end window)"),
                              ("engine_gap", "engine gap |log π_j^Meg − log π_SGL| (run mean)")):  # fmt: skip
                off = c[key][0]  # the R3-off cell's mean; d[key] = off − on, paired by seed
                red, h = -d[key][0] / off, d[key][1] / off
                parts.append(f"{what} {100 * red:+.0f}% ± {100 * h:.0f}% (R3 off: {off:.4f})")
            out.append(f"* routing replay at `s{s}-{loss}-{n}`, change with R3 vs without "
                       f"({k:.0f} seed-paired): {'; '.join(parts)}; Relax's figure: −38% "
                       f"or better")  # fmt: skip
    for key, what in (("gap_end", "train–rollout gap (end window)"),
                      ("engine_gap", "engine gap |log π_j^Meg − log π_SGL|")):  # fmt: skip
        rows = an.get("replay", {}).get(key, {})
        if not rows or not rows["all"][3]:
            continue
        each = ", ".join(f"{k} {100 * v[0]:+.0f}% ({v[3]:.0f})" for k, v in rows.items()
                         if k != "all")  # fmt: skip
        m, lo, hi, k = rows["all"]
        met = "yes" if hi <= -0.38 else ("no" if lo > -0.38 else "not resolved")
        out.append(f"* routing replay, pooled over {k:.0f} seed-paired run pairs, {what}: "
                   f"{100 * m:+.0f}% [{100 * lo:+.0f}%, {100 * hi:+.0f}%] (geometric mean "
                   f"on/off, 95% interval); −38% or better: {met}. By staleness: {each}")  # fmt: skip
    return out


def _parts(g: str) -> tuple[int, str, str, str]:
    parts = g.split("-")
    return int(parts[0][1:]), "-".join(parts[1:-2]), parts[-2], parts[-1]


def guard_table(cal: dict[str, Any]) -> list[str]:
    """Markdown: each guard's hit rate on unstable vs stable runs per threshold value."""
    nu, ns = cal["n_unstable"], cal["n_stable"]
    out = [f"Divergence guards (`slime_async/metrics/guards.py`) on the {nu} unstable "
           f"(drifting/collapsed) and {ns} stable runs; * marks the default threshold:", "",
           "| guard | threshold | fired on unstable | fired on stable |", "|---|---|---|---|"]  # fmt: skip
    for kind, sw in cal["sweep"].items():
        for row in sw["rows"]:
            star = "*" if row["default"] else ""
            out.append(f"| {kind} | {sw['field']}={row['value']:g}{star} | "
                       f"{row['unstable_hits']}/{nu} | {row['stable_hits']}/{ns} |")  # fmt: skip
    return out


# ---------------------------------------------------------------------------------- main
def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _strs(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--out", default="runs/stability", help="Output directory (default: %(default)s)."
    )
    p.add_argument("--quick", action="store_true",
                   help="Quick grid: staleness 0,16 x ppo,compis x R3 on x 4 steps/rollout x 3 "
                        "seeds, 50 rollouts each (each axis flag below still overrides).")  # fmt: skip
    p.add_argument("--staleness", type=_ints, help="Comma-separated --max-staleness values.")
    p.add_argument("--losses", type=_strs, help=f"Comma-separated losses ({', '.join(LOSSES)}).")
    p.add_argument("--replay", type=_strs, help="Routing replay: on, off or on,off.")
    p.add_argument("--nspr", type=_ints, help="Comma-separated --num-steps-per-rollout values.")
    p.add_argument("--seeds", type=_ints, help="Comma-separated seeds.")
    p.add_argument("--num-rollout", type=int, help="Rollouts per run (the sample budget).")
    p.add_argument("--eval-interval", type=int, help="Eval every N rollouts.")
    p.add_argument("--eval-prompts", type=int, default=172,
                   help="Held-out prompts per eval (the built-in tasks hold 43 per level; "
                        "default: %(default)s).")  # fmt: skip
    p.add_argument("--eval-samples", type=int, default=4,
                   help="Samples per held-out prompt (--n-samples-per-eval-prompt); 172 x 4 "
                        "puts the eval's standard error under 0.02 (default: %(default)s).")  # fmt: skip
    p.add_argument(
        "--warmstart-steps",
        type=int,
        default=None,
        help="Passed to every run (default: the run's own default).",
    )
    p.add_argument("--cells", help="Comma-separated fnmatch patterns on run names, e.g. "
                                   "'s16-compis-*,s0-*-seed1'.")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="Runs at a time (default: 1).")
    p.add_argument("--stall-timeout", type=float, default=1800.0,
                   help="Kill a run (its whole process group) whose metrics.jsonl (before its "
                        "first step: its log) has not changed for this many seconds, and count "
                        "it failed; a resume runs it again. 0: never (default: %(default)s).")  # fmt: skip
    p.add_argument(
        "--smooth",
        type=float,
        default=0.05,
        help="Moving-average window of the curves, as a fraction of the steps.",
    )
    p.add_argument("--report-only", action="store_true", help="Only read finished runs and report.")
    p.add_argument("--dry-run", action="store_true", help="Print the runs and their commands.")
    a = p.parse_args(argv)
    a.extra = tuple(extra)
    base = QUICK if a.quick else FULL
    for k in ("staleness", "losses", "replay", "nspr", "seeds", "num_rollout", "eval_interval"):
        if getattr(a, k) is None:
            setattr(a, k, base[k])
    if a.jobs < 1:
        p.error(f"--jobs {a.jobs}: give 1 or more")
    if not 0 <= a.stall_timeout < float("inf"):
        p.error(f"--stall-timeout {a.stall_timeout}: give seconds > 0, or 0 for never")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    out = Path(a.out).resolve()
    cells = select(grid(a.staleness, a.losses, a.replay, a.nspr, a.seeds), a.cells)
    if not cells:
        print(f"no run matches --cells {a.cells!r}", file=sys.stderr)
        return 2
    budget = Budget(num_rollout=a.num_rollout, eval_interval=a.eval_interval,
                    eval_prompts=a.eval_prompts, eval_samples=a.eval_samples,
                    warmstart_steps=a.warmstart_steps, extra=a.extra)  # fmt: skip
    if a.dry_run:
        for c in cells:
            print(c.name, " ".join(train_args(c, budget, out / "runs" / c.name, None)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    try:
        if not a.report_only:
            run_grid(cells, budget, out, jobs=a.jobs, stall_s=a.stall_timeout or None)
        runs = load_runs(out, cells, budget)
    except BudgetMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not runs:
        print("no finished runs to report", file=sys.stderr)
        return 1
    rules = VerdictRules()
    an = analyse(runs, rules)
    command = "python scripts/bench_stability.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    render_figure(runs, out / "stability.png", smooth=a.smooth)
    (out / "stability.md").write_text(render_markdown(an, runs, command))
    (out / "summary.json").write_text(json.dumps(an, indent=1, default=str))
    print((out / "stability.md").read_text())
    print(f"wrote {out / 'stability.png'}, {out / 'stability.md'}, {out / 'summary.json'} "
          f"({len(runs)} of {len(cells)} runs finished)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
