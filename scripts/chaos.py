"""Chaos test of the whole run: random kill -9 of the run and of single engines, then resume.

Runs the default training (shortened) `--runs` times. Each run is started, and while it is
alive the script waits a random time and then, at random, kills the whole process group
(SIGKILL: driver, Ray roles, everything) or one engine (SIGKILL of its pid from `roles.json`).
A killed run is restarted with `--load`; a killed engine must be replaced by the supervisor
while the run goes on. At the end of each run, the prompt ledger (`trained.jsonl`) and the
data-worker state in the final checkpoint are checked against each other:

  dispatched = groups ever admitted (next submission sequence number)
  trained    = distinct groups in the ledger (a repeat would be a bug, counted)
  dropped    = groups dropped as too stale or filtered (counted by the worker)
  pending    = groups admitted but not yet trained (re-issued on resume)
  lost       = dispatched − trained − dropped − pending   (must be 0)

Every run starts from an empty `run<i>/` (a directory left by an earlier invocation is removed
first), so the script can be run again and again in one `--out` directory. A run without any
complete checkpoint (killed before its first save, then out of time) reports lost = None and
fails the check instead of crashing. Loopback only, bounded in time (`--time-limit`), stops by
itself.

    .venv/bin/python scripts/chaos.py --runs 3 --num-steps 12

Cluster mode (`--cluster`, root): two Ray nodes from network namespaces; node B (trainer rank
1 and an engine, no view of the run directory) is killed whole at random steps, each stop must
be the resumable one-line stop, node B is started again and the run resumed with `--load`; the
ledger is audited at the end and the time from each kill to the next newly trained step is
reported.

    .venv/bin/python scripts/chaos.py --cluster --node-kills 10 --num-steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's slime_async (for the checkpoint checks)

RUN_FLAGS = [
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "4",
    "--rollout-max-response-len",
    "10",
    "--warmstart-steps",
    "0",
    "--eval-interval",
    "0",
    "--micro-batch-size",
    "8",
    "--max-staleness",
    "2",
    "--engine-restart-after",
    "3",
    "--save-interval",
    "2",
]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "trained.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def latest_state(ckpt: Path) -> dict | None:
    """The run's state in its newest complete checkpoint (checked like a resume checks it), or
    None when the run never wrote one (e.g. killed before its first save, then out of time)."""
    from slime_async.trainer.checkpoint import CheckpointError, find_latest, read_meta

    try:
        return read_meta(find_latest(ckpt))["extra_state"]
    except CheckpointError:
        return None


def audit(run_dir: Path, ckpt: Path) -> dict:
    """Ledger vs the final data-worker state (see module docstring)."""
    ledger = run_dir / "trained.jsonl"
    rows = [json.loads(x) for x in ledger.read_text().splitlines()] if ledger.exists() else []
    seqs = [seq for r in rows for _key, seq, _j in r["groups"]]
    extra = latest_state(ckpt)
    if extra is None:
        print(f"  {run_dir.name}: no complete checkpoint in {ckpt}; nothing to audit")
        return {
            "dispatched": 0,
            "trained": len(set(seqs)),
            "repeated": len(seqs) - len(set(seqs)),
            "dropped": 0,
            "pending": 0,
            "pending_also_trained": 0,
            "lost": None,
            "final_step": max((r["step"] for r in rows), default=0),
        }
    state = extra["worker"]
    counters = state["counters"]
    pending = {p["seq"] for p in state["pending"]}
    trained = set(seqs)
    dropped = counters["n_dropped"] + counters["n_filtered"]
    dispatched = state["next_seq"]
    return {
        "dispatched": dispatched,
        "trained": len(trained),
        "repeated": len(seqs) - len(trained),
        "dropped": dropped,
        "pending": len(pending),
        "pending_also_trained": len(pending & trained),
        "lost": dispatched - len(trained) - dropped - len(pending),
        "final_step": max((r["step"] for r in rows), default=0),
    }


def progressed(run_dir: Path, *, since: float, past_step: int) -> bool:
    """This process trained a step of its own: the ledger was written after it started and
    holds more steps than the checkpoint it resumed from (a resume first cuts the ledger back
    to that step). Faults wait for this, so every restart makes progress before the next kill."""
    path = run_dir / "trained.jsonl"
    try:
        return path.stat().st_mtime > since and steps_done(run_dir) > past_step
    except FileNotFoundError:
        return False


def kill_engine(run_dir: Path) -> bool:
    """SIGKILL one engine the run owns (pids of attached external engines are null: skipped)."""
    try:
        pids = json.loads((run_dir / "roles.json").read_text())["engine_pids"]
        owned = [p for p in pids if isinstance(p, int)]
        if not owned:
            return False
        os.kill(random.choice(owned), signal.SIGKILL)
        return True
    except (OSError, ValueError, KeyError):
        return False


def one_run(i: int, out: Path, args: argparse.Namespace, deadline: float) -> dict:
    run_dir, ckpt = out / f"run{i}", out / f"run{i}" / "ckpt"
    # each invocation audits only its own run: a directory left by an earlier invocation (its
    # ledger, checkpoints, log) would otherwise be resumed and counted
    shutil.rmtree(run_dir, ignore_errors=True)
    (out / f"run{i}.log").unlink(missing_ok=True)
    base = [
        sys.executable,
        str(ROOT / "train_async.py"),
        "--run-dir",
        str(run_dir),
        "--save",
        str(ckpt),
        "--num-steps",
        str(args.num_steps),
        "--seed",
        str(args.seed + i),
        *RUN_FLAGS,
    ]
    stats = {"run_kills": 0, "engine_kills": 0, "resumes": 0}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    while time.monotonic() < deadline:
        cmd = [*base, "--load", str(ckpt)] if (ckpt / "latest").exists() else base
        stats["resumes"] += int("--load" in cmd)
        latest = ckpt / "latest"
        past_step = int(latest.read_text().strip()) if latest.exists() else 0
        started = time.time()
        with open(out / f"run{i}.log", "a") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        fault_at = time.monotonic() + random.uniform(args.min_wait, args.max_wait)
        while proc.poll() is None and time.monotonic() < deadline:
            if time.monotonic() >= fault_at and progressed(
                run_dir, since=started, past_step=past_step
            ):
                if random.random() < args.p_run_kill:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    stats["run_kills"] += 1
                    print(f"  run{i}: killed the whole run at step {steps_done(run_dir)}")
                    break
                if kill_engine(run_dir):
                    stats["engine_kills"] += 1
                    print(f"  run{i}: killed an engine at step {steps_done(run_dir)}")
                fault_at = time.monotonic() + random.uniform(args.min_wait, args.max_wait)
            time.sleep(0.2)
        if proc.poll() is None:  # out of time
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        if proc.returncode == 0:
            break
        if proc.returncode != -signal.SIGKILL:
            print(f"  run{i}: exited with {proc.returncode}; see {out / f'run{i}.log'}")
            break
    return {**stats, **audit(run_dir, ckpt)}


CLUSTER_FLAGS = [
    *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
    *("--rollout-max-response-len", "8", "--micro-batch-size", "2"),
    *("--warmstart-steps", "0", "--eval-interval", "0", "--max-staleness", "1"),
    *("--num-engines", "2", "--rollout-num-cpus-per-engine", "1"),
    *("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1"),
    *("--actor-num-cpus-per-rank", "2", "--update-weight-transport", "distributed"),
    *("--save-interval", "1"),
]
CLUSTER_TOKEN = "sa33-chaos-token-0123456789abcdef"


def cluster_run(out: Path, args: argparse.Namespace, deadline: float) -> dict:
    """One run on two network-namespace nodes (tests/netns_nodes.py): node B holds trainer
    rank 1 and an engine; it is killed (every process at once) at a random step after the run
    made progress, the run must stop with its one-line reason (exit 3), node B is started
    again and the run resumed with `--load` until it finishes. Returns kills, resumable stops,
    kill -> first newly trained step times and the ledger audit."""
    from tests.netns_nodes import TwoNodes, skip_reason

    if reason := skip_reason():
        raise SystemExit(f"cluster mode cannot run here: {reason}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    run_dir, ckpt = out / "run", Path(f"{out}_shared") / "ckpt"  # --save: both nodes see it
    shutil.rmtree(ckpt.parent, ignore_errors=True)
    nodes = TwoNodes(hide=[out])  # node B cannot see the run directory
    stats: dict = {"node_kills": 0, "resumable": 0, "resumes": 0, "to_training_s": []}
    env = {**nodes.env, "SLIME_ASYNC_AUTH_TOKEN": CLUSTER_TOKEN, "PYTHONUNBUFFERED": "1"}
    base = [
        sys.executable,
        "train_async.py",
        *("--ray-address", f"{nodes.ip_a}:6379", "--run-dir", str(run_dir)),
        *("--save", str(ckpt), "--num-steps", str(args.num_steps), "--seed", str(args.seed)),
        *CLUSTER_FLAGS,
    ]
    killed_at: float | None = None
    try:
        nodes.up()
        while time.monotonic() < deadline:
            cmd = [*base, "--load", str(ckpt)] if (ckpt / "latest").exists() else base
            stats["resumes"] += int("--load" in cmd)
            latest = ckpt / "latest"
            past_step = int(latest.read_text().strip()) if latest.exists() else 0
            started = time.time()
            log = out / f"attempt{stats['resumes']}.log"
            proc = nodes.popen(cmd, env=env, log=log)
            kill_after, killed_here = random.randint(1, args.kill_max_steps), False
            while proc.poll() is None and time.monotonic() < deadline:
                moved = progressed(run_dir, since=started, past_step=past_step)
                if killed_at is not None and not killed_here and moved:  # training again
                    stats["to_training_s"].append(round(time.monotonic() - killed_at, 1))
                    killed_at = None
                if (
                    stats["node_kills"] < args.node_kills
                    and killed_at is None
                    and moved
                    and steps_done(run_dir) >= past_step + kill_after
                ):
                    print(f"  killing node B at step {steps_done(run_dir)}", flush=True)
                    nodes.kill_b()
                    killed_at, killed_here = time.monotonic(), True
                    stats["node_kills"] += 1
                time.sleep(0.2)
            if proc.poll() is None:  # out of time
                proc.kill()
                proc.wait()
                break
            if proc.returncode == 0:
                break
            text = log.read_text()
            stopped = [x for x in text.splitlines() if x.startswith("train_async: stopped:")]
            if proc.returncode == 3 and stopped and "resume with:" in stopped[0]:
                stats["resumable"] += 1
                print(f"  {stopped[0][:160]}...", flush=True)
            else:
                print(f"  exited with {proc.returncode} without a resumable stop; see {log}")
                break
            nodes.start_b()
            nodes.wait_nodes(2)
    finally:
        survivors = nodes.down()
        if survivors:
            print(f"  processes left in the namespaces: {survivors}")
    result = {**stats, **audit(run_dir, ckpt)}
    shutil.rmtree(ckpt.parent, ignore_errors=True)
    return result


def cluster_main(args: argparse.Namespace) -> int:
    random.seed(args.seed)
    deadline = time.monotonic() + args.time_limit
    r = cluster_run(Path(args.out) / "cluster", args, deadline)
    times = sorted(r["to_training_s"])
    median = times[len(times) // 2] if times else None
    print(
        f"node kills {r['node_kills']}, resumable stops {r['resumable']}, resumes "
        f"{r['resumes']}, kill -> training again: median {median} s (all: {times}); "
        f"dispatched {r['dispatched']}, trained {r['trained']}, repeated {r['repeated']}, "
        f"dropped {r['dropped']}, pending {r['pending']}, lost {r['lost']}, "
        f"final step {r['final_step']} of {args.num_steps}"
    )
    ok = (
        r["lost"] == 0
        and r["repeated"] == 0
        and r["pending_also_trained"] == 0
        and r["final_step"] == args.num_steps
        and r["resumable"] == r["node_kills"]
    )
    print("CHAOS", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--cluster",
        action="store_true",
        help="Two network-namespace nodes (root): kill node B (trainer rank 1 + an engine) "
        "--node-kills times, restart it, resume with --load, audit the ledger.",
    )
    p.add_argument("--node-kills", type=int, default=10, help="Cluster mode: node kills.")
    p.add_argument(
        "--kill-max-steps",
        type=int,
        default=3,
        help="Cluster mode: kill after 1..N steps trained by the current attempt.",
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-wait", type=float, default=3.0, help="Seconds before a fault, min.")
    p.add_argument("--max-wait", type=float, default=20.0, help="Seconds before a fault, max.")
    p.add_argument(
        "--p-run-kill",
        type=float,
        default=0.5,
        help="Probability a fault kills the whole run (else one engine).",
    )
    p.add_argument("--time-limit", type=float, default=1800.0, help="Total seconds, all runs.")
    p.add_argument("--out", default="bench_out/chaos")
    args = p.parse_args(argv)
    if args.cluster:
        return cluster_main(args)
    random.seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.time_limit
    results = []
    for i in range(args.runs):
        print(f"run {i}")
        results.append(one_run(i, out, args, deadline))
    cols = [
        "run_kills",
        "engine_kills",
        "resumes",
        "dispatched",
        "trained",
        "repeated",
        "dropped",
        "pending",
        "lost",
        "final_step",
    ]
    print("| run | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for i, r in enumerate(results):
        print(f"| {i} | " + " | ".join(str(r[c]) for c in cols) + " |")
    total = {c: sum(r[c] or 0 for r in results) for c in cols if c != "final_step"}
    print("total:", total)
    ok = all(
        r["lost"] == 0
        and r["repeated"] == 0
        and r["pending_also_trained"] == 0
        and r["final_step"] == args.num_steps
        for r in results
    )
    print("CHAOS", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
