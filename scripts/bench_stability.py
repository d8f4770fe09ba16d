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
  error over seeds (curves smoothed over `--smooth` of the steps). The per-source split
  (r2/r3) needs π_j^Meg, which only `compis` reads; the other losses show the combined ratio;
* `stability.md`: the table of final values (mean ± 95% t-interval over seeds), the verdict
  of every run and cell (`slime_async.metrics.stability`: stable / drifting / collapsed), the
  goal checks (`lab.goals`) and the divergence guards' hit rates on unstable vs stable runs;
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
import json
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
sys.path.insert(0, str(ROOT))  # this tree: slime_async and the lab package

from lab.analysis import (  # noqa: E402
    LOSSES,
    RESULT,
    Budget,
    BudgetMismatch,
    Cell,
    analyse,
    budget_record,
    grid,
    is_done,
    load_runs,
    read_load_log,
    select,
    train_args,
)
from lab.report import render_figure, render_markdown  # noqa: E402
from slime_async.metrics import read_metrics  # noqa: E402
from slime_async.metrics.stability import VerdictRules  # noqa: E402

FULL = dict(
    staleness=(0, 1, 4, 8, 16),
    losses=("ppo", "decoupled_ppo", "tis", "compis"),
    replay=("on", "off"),
    nspr=(1, 4),
    seeds=(1, 2, 3),
    num_rollout=50,
    eval_interval=10,
)
"""The lab's full grid: every axis, at the quick form's budget (so the quick runs are its runs;
240 runs of 50 rollouts are ~5 hours on 2 cores, of 200 rollouts ~27; `--num-rollout 200`)."""


QUICK = dict(
    staleness=(0, 16),
    losses=("ppo", "compis"),
    replay=("on",),
    nspr=(4,),
    seeds=(1, 2, 3),
    num_rollout=50,
    eval_interval=10,
)


# ---------------------------------------------------------------------------------- running
def prepare_warmstart(out: Path, seed: int, steps: int | None) -> Path:
    """The warm-started model of `seed` under `out/warmstart/seed<seed>`, trained once, exactly
    as train_async.py would (same spec, task config and warm-start config, so its hash
    matches and the run reuses it)."""
    from slime_async.config.run_config import run_default
    from slime_async.contracts.model import TINY_MOE
    from slime_async.orchestrator.warmstart import WarmStartConfig, warm_start
    from slime_async.rollout.data.tasks import TaskFamilyConfig

    steps = run_default("warmstart_steps") if steps is None else steps
    res = warm_start(
        out / "warmstart" / f"seed{seed}",
        spec=TINY_MOE,
        task=TaskFamilyConfig(seed=seed),
        config=WarmStartConfig(max_steps=steps, seed=seed, num_threads=1),
        say=lambda m: print(f"[warmstart seed {seed}] {m}", flush=True),
    )
    return res.path


TIMED_OUT = 124
"""A run's return code when it was killed as stalled (as `timeout(1)` reports a timeout)."""


POLL_S = 2.0
"""How often `run_logged` looks at a run's progress."""


def run_logged(
    cmd: Sequence[str],
    log: Any,
    *,
    env: dict[str, str],
    progress: Sequence[Path],
    stall_s: float | None,
) -> int:
    """Run `cmd` (in its own process group, output to `log`) and return its exit code. A run
    whose progress file (the first of `progress` that exists: its metrics.jsonl, else its log)
    has not changed for `stall_s` is hung: the whole group (the run's Ray node and actors too)
    is killed and the code is `TIMED_OUT`, so one hung run never stalls the grid, while a slow
    one (a real model's step can take minutes) runs as long as it moves."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    last, mark = time.monotonic(), None
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        state = next(
            ((p, p.stat().st_mtime_ns, p.stat().st_size) for p in progress if p.exists()), None
        )
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


def run_cell(
    cell: Cell,
    budget: Budget,
    out: Path,
    *,
    cores: tuple[int, int] | None,
    warmstart: Path | None,
    python: str,
    stall_s: float | None = None,
) -> dict[str, Any]:
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
        rc = run_logged(
            cmd,
            log,
            env=env,
            stall_s=stall_s,
            progress=(run_dir / "metrics.jsonl", run_dir / "train.log"),
        )
    wall = time.monotonic() - t0
    steps = 0
    if (run_dir / "metrics.jsonl").exists():
        steps = max((r["step"] for r in read_metrics(run_dir / "metrics.jsonl").records), default=0)
    expected = budget.num_rollout * cell.nspr
    status = "ok" if rc == 0 and steps >= expected else "failed"
    result = {
        "status": status,
        "cell": dataclasses.asdict(cell),
        "group": cell.group,
        "rc": rc,
        "steps": steps,
        "expected_steps": expected,
        "wall_s": round(wall, 1),
        "command": cmd[1:],
        "budget": budget_record(budget),
    }
    (run_dir / RESULT).write_text(json.dumps(result, indent=1))
    return result


def run_grid(
    cells: Sequence[Cell], budget: Budget, out: Path, *, jobs: int, stall_s: float | None = None
) -> None:
    """Run the cells not done yet, `jobs` at a time; print one line per finished run."""
    todo = [c for c in cells if not is_done(out / "runs" / c.name, budget)]
    print(
        f"{len(cells) - len(todo)} of {len(cells)} runs already done; {len(todo)} to run "
        f"({jobs} at a time)",
        flush=True,
    )
    if not todo:
        return
    own = ("--hf-checkpoint", "--prompt-data", "--prompt-source", "--load", "--config")
    embedded = not any(f in budget.extra for f in own)  # else no tiny-model warm start
    ws: dict[int, Path] = {}
    seed_locks = {seed: threading.Lock() for seed in {c.seed for c in todo}}

    def warmstart(seed: int) -> Path | None:
        """The seed's warm start, trained when its first run starts (once: a lock per seed),
        so the first runs need not wait for every seed's warm start."""
        if not embedded or budget.warmstart_steps == 0:
            return None
        with seed_locks[seed]:
            if seed not in ws:
                ws[seed] = prepare_warmstart(out, seed, budget.warmstart_steps)
            return ws[seed]

    usable = sorted(os.sched_getaffinity(0))
    pairs = (
        [(usable[2 * i], usable[2 * i + 1]) for i in range(jobs)]
        if jobs > 1 and len(usable) >= 2 * jobs
        else None
    )
    free = list(range(jobs))
    lock = threading.Lock()

    def one(cell: Cell) -> dict[str, Any]:
        with lock:
            slot = free.pop()
        try:
            return run_cell(
                cell,
                budget,
                out,
                cores=pairs[slot] if pairs else None,
                warmstart=warmstart(cell.seed),
                python=sys.executable,
                stall_s=stall_s,
            )
        finally:
            with lock:
                free.append(slot)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(one, c): c for c in todo}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            c, res = futures[fut], fut.result()
            print(
                f"[{i}/{len(todo)}] {c.name}: {res['status']} (rc {res['rc']}, "
                f"{res['steps']}/{res['expected_steps']} steps, {res['wall_s']:.0f}s; "
                f"{time.monotonic() - t0:.0f}s elapsed)",
                flush=True,
            )


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
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out", default="runs/stability", help="Output directory (default: %(default)s)."
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="Quick grid: staleness 0,16 x ppo,compis x R3 on x 4 steps/rollout x 3 "
        "seeds, 50 rollouts each (each axis flag below still overrides).",
    )
    p.add_argument("--staleness", type=_ints, help="Comma-separated --max-staleness values.")
    p.add_argument("--losses", type=_strs, help=f"Comma-separated losses ({', '.join(LOSSES)}).")
    p.add_argument("--replay", type=_strs, help="Routing replay: on, off or on,off.")
    p.add_argument("--nspr", type=_ints, help="Comma-separated --num-steps-per-rollout values.")
    p.add_argument("--seeds", type=_ints, help="Comma-separated seeds.")
    p.add_argument("--num-rollout", type=int, help="Rollouts per run (the sample budget).")
    p.add_argument("--eval-interval", type=int, help="Eval every N rollouts.")
    p.add_argument(
        "--eval-prompts",
        type=int,
        default=172,
        help="Held-out prompts per eval (the built-in tasks hold 43 per level; "
        "default: %(default)s).",
    )
    p.add_argument(
        "--eval-samples",
        type=int,
        default=4,
        help="Samples per held-out prompt (--n-samples-per-eval-prompt); 172 x 4 "
        "puts the eval's standard error under 0.02 (default: %(default)s).",
    )
    p.add_argument(
        "--warmstart-steps",
        type=int,
        default=None,
        help="Passed to every run (default: the run's own default).",
    )
    p.add_argument(
        "--cells",
        help="Comma-separated fnmatch patterns on run names, e.g. 's16-compis-*,s0-*-seed1'.",
    )
    p.add_argument("--jobs", type=int, default=1, help="Runs at a time (default: 1).")
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=1800.0,
        help="Kill a run (its whole process group) whose metrics.jsonl (before its "
        "first step: its log) has not changed for this many seconds, and count "
        "it failed; a resume runs it again. 0: never (default: %(default)s).",
    )
    p.add_argument(
        "--smooth",
        type=float,
        default=0.05,
        help="Moving-average window of the curves, as a fraction of the steps.",
    )
    p.add_argument(
        "--protocol",
        action="store_true",
        help="Run docs/stability-protocol.md on the tiny model: the search over its regimes, "
        "the rule that picks one, then the confirmatory cells in the protocol's order, and "
        "its report (under --out). Resumable; the axis flags are ignored.",
    )
    p.add_argument(
        "--phase3",
        action="store_true",
        help="With --protocol: once phase 2 is complete, also run phase 3 (SmolLM2-135M, "
        "one run at a time: each holds several GiB) under --out/smollm2.",
    )
    p.add_argument(
        "--load-log",
        help="For runs that did not log their node's load (`timing/node_load_1m`): a file of "
        "'<unix time> <1-minute load>' lines sampled while they ran; each run's mean load is "
        "then reported beside its wall time.",
    )
    p.add_argument(
        "--quiet-load",
        type=float,
        default=2.5 * (os.cpu_count() or 1),
        help="Speedups are also reported over the seeds whose runs each kept the node's mean "
        "load at or below this (default: 2.5 per CPU, %(default)s here: one run alone on the "
        "2-core machine kept it at 3-4).",
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


def _shared_warmstart(out: Path, d: Path) -> None:
    """Every phase of the protocol reuses one warm start per seed (`out/warmstart`)."""
    d.mkdir(parents=True, exist_ok=True)
    (out / "warmstart").mkdir(parents=True, exist_ok=True)
    if not (d / "warmstart").exists():
        (d / "warmstart").symlink_to(Path("..") / "warmstart")


def run_protocol(a: argparse.Namespace, out: Path) -> int:
    """docs/stability-protocol.md, phases 1 and 2 on the tiny model (and with `--phase3`,
    phase 3 on SmolLM2), then its report."""
    from lab.protocol import REGIMES, choose_regime, confirm_cells, search_cells
    from lab.protocol_report import regime_outcome, render_protocol

    rules = VerdictRules()
    base = Budget(
        num_rollout=FULL["num_rollout"],
        eval_interval=FULL["eval_interval"],
        eval_prompts=a.eval_prompts,
        eval_samples=a.eval_samples,
        warmstart_steps=a.warmstart_steps,
        extra=a.extra,
    )
    stall = a.stall_timeout or None
    outcomes, search_runs, judged, budgets = [], {}, [], {}
    for regime in REGIMES:
        d, rb = (
            out / f"search-{regime.name}",
            dataclasses.replace(base, extra=a.extra + regime.flags),
        )
        budgets[regime.name] = rb
        _shared_warmstart(out, d)
        if not a.report_only:
            run_grid(search_cells(), rb, d, jobs=a.jobs, stall_s=stall)
        runs = load_runs(d, search_cells(), rb)
        per_run = analyse(runs, rules)["runs"] if runs else {}
        outcomes.append(regime_outcome(regime.name, per_run))
        search_runs[regime.name] = per_run
        judged += [
            (f"{regime.name}/{r.cell.name}", r, per_run[r.cell.name]["verdict"]) for r in runs
        ]
    done = sum(len(v) for v in search_runs.values()) == len(REGIMES) * len(search_cells())
    choice = choose_regime(outcomes) if done else None
    confirm_per_run: dict[str, Any] = {}
    confirm_runs: list = []
    cells = confirm_cells()
    if choice is not None:
        d, rb = out / "confirm", budgets[choice[0]]
        _shared_warmstart(out, d)
        (out / "choice.json").write_text(json.dumps({"regime": choice[0], "broke": choice[1]}))
        if not a.report_only:
            run_grid(cells, rb, d, jobs=a.jobs, stall_s=stall)
        confirm_runs = load_runs(d, cells, rb)
        if confirm_runs:
            an = analyse(confirm_runs, rules)
            confirm_per_run = an["runs"]
            judged += [
                (f"confirm/{r.cell.name}", r, confirm_per_run[r.cell.name]["verdict"])
                for r in confirm_runs
            ]
            render_figure(confirm_runs, out / "confirm.png", smooth=a.smooth)
            (out / "confirm.md").write_text(render_markdown(an, confirm_runs, "protocol: confirm"))
    phase3 = (
        run_phase3(a, out, confirm_per_run, stall)
        if a.phase3 and len(confirm_runs) == len(cells)
        else ("Phase 3 waits for phase 2.\n" if a.phase3 else "")
    )
    text = render_protocol(
        outcomes=outcomes,
        choice=choice,
        search_runs=search_runs,
        confirm_per_run=confirm_per_run,
        confirm_runs=confirm_runs,
        planned=len(cells),
        judged=judged,
        rules=rules,
    )
    text += phase3 and f"\n{phase3}"
    (out / "protocol.md").write_text(text)
    print(text)
    return 0


def run_phase3(
    a: argparse.Namespace, out: Path, confirm_per_run: dict[str, Any], stall: float | None
) -> str:
    """Phase 3 of docs/stability-protocol.md (amendment 2): workload S at the staleness where
    phase 2's arms differ most, one run at a time; returns its markdown."""
    from lab.protocol import WORKLOAD_S, phase3_cells, phase3_staleness
    from lab.protocol_report import render_phase3

    rules = VerdictRules()
    by_group: dict[str, list[float]] = {}
    for r in confirm_per_run.values():
        by_group.setdefault(r["group"], []).append(r["eval_final"])
    staleness = phase3_staleness({g: sum(v) / len(v) for g, v in by_group.items()})
    d, w = out / "smollm2", WORKLOAD_S
    budget = Budget(
        num_rollout=w.steps,
        eval_interval=w.eval_interval,
        eval_prompts=w.eval_prompts,
        eval_samples=w.eval_samples,
        warmstart_steps=None,
        extra=("--config", str(w.recipe), *w.flags, *a.extra),  # runs start in ROOT
    )
    cells = phase3_cells(staleness)
    if not a.report_only:
        run_grid(cells, budget, d, jobs=1, stall_s=stall)
    log = read_load_log(Path(a.load_log) if a.load_log else None)
    runs = load_runs(d, cells, budget, load_log=log)
    per_run = analyse(runs, rules)["runs"] if runs else {}
    if runs:
        render_figure(runs, out / "smollm2.png", smooth=a.smooth)
    return render_phase3(
        staleness=staleness,
        per_run=per_run,
        runs=runs,
        planned=len(cells),
        rules=rules,
        quiet_load=a.quiet_load,
    )


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    out = Path(a.out).resolve()
    if a.protocol:
        return run_protocol(a, out)
    cells = select(grid(a.staleness, a.losses, a.replay, a.nspr, a.seeds), a.cells)
    if not cells:
        print(f"no run matches --cells {a.cells!r}", file=sys.stderr)
        return 2
    budget = Budget(
        num_rollout=a.num_rollout,
        eval_interval=a.eval_interval,
        eval_prompts=a.eval_prompts,
        eval_samples=a.eval_samples,
        warmstart_steps=a.warmstart_steps,
        extra=a.extra,
    )
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
    print(
        f"wrote {out / 'stability.png'}, {out / 'stability.md'}, {out / 'summary.json'} "
        f"({len(runs)} of {len(cells)} runs finished)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
