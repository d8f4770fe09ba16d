"""Synchronous, one-step and fully-async training against the async bound, measured in one run.

Runs `train_async.py` once per arm with the same seed, warm start and sample budget (every arm
trains `--num-steps` steps of the same batch size: equal samples), trainer and engines on
disjoint cores, for each workload:

  default      the embedded default run (built-in digit tasks, warm-started model)
  long-gen     generations long relative to training: an untrained model that rarely stops,
               --rollout-max-response-len 96 (responses run to the budget)
  train-heavy  training long relative to generation: --micro-batch-size 2 (16 micro-batches
               of fwd+bwd per step on the same samples)

and arms (plain PPO; CompIS with snapshots, π_j^Meg from the forward-only role unless said):

  sync-ppo / onestep-ppo / async-ppo           --loss ppo, --max-staleness 0 / 1 / S
  sync-compis / onestep-compis / async-compis  CompIS --keep-old-actor --behavior-forward role
  async-compis-trainer                         CompIS, π_j^Meg in the train step (the old way)

It prints per arm the wall time, samples/hour, per-step phases (wait for a batch, train, weight
sync; the trainer's fwd+bwd and π_j^Meg time), the trainer idle ratio (mean of the per-step
`idle/trainer_ratio` in metrics.jsonl), the rollout idle ratio and the busier side's busy share
(in an async arm: how close the pipeline runs to what its own phase times allow, whatever the
load); per workload and loss the
bound (Tg + Tt) / max(Tg, Tt) from the sync arm's phases (Tg: its wait for a batch, Tt: train +
weight sync) and each arm's speed-up over sync and ratio to that bound; and CompIS's train-step
time over plain PPO's at each staleness in `--staleness`. Writes its table and numbers into
the `--out` directory (markdown and JSON).

    .venv/bin/python scripts/bench_async.py --num-steps 30
    .venv/bin/python scripts/bench_async.py --workloads default --staleness 2 8 16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKLOADS: dict[str, list[str]] = {
    "default": [],
    "long-gen": ["--warmstart-steps", "0", "--rollout-max-response-len", "96"],
    "train-heavy": ["--micro-batch-size", "2"],
}
"""Extra flags per workload (the default workload warm-starts from a shared checkpoint)."""

PPO = ["--loss", "ppo"]
COMPIS = ["--keep-old-actor", "--behavior-forward", "role"]
COMPIS_TRAINER = ["--keep-old-actor", "--behavior-forward", "trainer"]


def arms(staleness: list[int]) -> dict[str, list[str]]:
    """Arm name → flags: sync / one-step / async at the first S, then the staleness sweep."""
    s0 = staleness[0]
    out = {
        "sync-ppo": ["--max-staleness", "0", *PPO],
        "onestep-ppo": ["--max-staleness", "1", *PPO],
        f"async-ppo-S{s0}": ["--max-staleness", str(s0), *PPO],
        "sync-compis": ["--max-staleness", "0", *COMPIS],
        "onestep-compis": ["--max-staleness", "1", *COMPIS],
        f"async-compis-S{s0}": ["--max-staleness", str(s0), *COMPIS],
        f"async-compis-trainer-S{s0}": ["--max-staleness", str(s0), *COMPIS_TRAINER],
    }
    for s in staleness[1:]:
        out[f"async-ppo-S{s}"] = ["--max-staleness", str(s), *PPO]
        out[f"async-compis-S{s}"] = ["--max-staleness", str(s), *COMPIS]
        out[f"async-compis-trainer-S{s}"] = ["--max-staleness", str(s), *COMPIS_TRAINER]
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else 0.0


def load() -> str:
    a, b, c = os.getloadavg()
    return f"load {a:.1f} {b:.1f} {c:.1f}"


def run_arm(workload: str, name: str, flags: list[str], out: Path, common: list[str]) -> dict:
    run_dir = out / workload / name
    cmd = [
        sys.executable,
        str(ROOT / "train_async.py"),
        "--run-dir",
        str(run_dir),
        *common,
        *WORKLOADS[workload],
        *flags,
    ]
    before = load()
    print(f"[{workload}/{name}] {' '.join(cmd[2:])} ({before})", flush=True)
    for attempt in (1, 2):  # a start-up failure (e.g. a port taken meanwhile) gets one retry
        t0 = time.perf_counter()
        with open(out / workload / f"{name}.log", "w") as log:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        if done.returncode == 0:
            break
        print(f"[{workload}/{name}] failed (attempt {attempt}): see {log.name}", flush=True)
        if attempt == 2:
            done.check_returncode()
        shutil.rmtree(run_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    return summarize(workload, name, run_dir, wall=wall, before=before, after=load())


def summarize(
    workload: str, name: str, run_dir: Path, *, wall: float, before: str, after: str
) -> dict:
    """One arm's numbers from its metrics.jsonl (steady state: steps 2..N)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "train/version" in r]
    steady = train[1:]  # from the end of step 1: startup and the first batch left out
    samples_per_step = train[0]["rollout/samples"]
    span = train[-1]["timing/elapsed_s"] - train[0]["timing/elapsed_s"]
    return {
        "workload": workload,
        "name": name,
        "load_before": before,
        "load_after": after,
        "wall_s": wall,
        "steady_s": span,
        "samples": samples_per_step * len(train),
        "samples_per_hour": samples_per_step * len(steady) / max(span, 1e-9) * 3600,
        "idle_trainer": _mean(steady, "idle/trainer_ratio"),
        "idle_rollout": _mean(steady, "idle/rollout_ratio"),
        "t_wait": _mean(steady, "timing/wait_batch_s"),
        "t_train": _mean(steady, "timing/train_s"),
        "t_sync": _mean(steady, "timing/weight_sync_s"),
        "t_fwd_bwd": _mean(steady, "timing/train_fwd_bwd_s"),
        "t_behavior": _mean(steady, "timing/behavior_logprobs_s"),
        "behavior_forwards": _mean(steady, "train/behavior_forwards"),
        "missing": sum(r.get("train/behavior_missing_tokens", 0.0) for r in steady),
        "fallback": _mean(steady, "loss/compis_fallback"),
        "staleness": _mean(steady, "staleness/mean"),
        "length": _mean(steady, "rollout/length"),
        "reward": _mean(train[-max(1, len(train) // 5) :], "rollout/reward"),
    }


def report(results: list[dict]) -> str:
    lines = []
    for wl in dict.fromkeys(r["workload"] for r in results):
        rs = {r["name"]: r for r in results if r["workload"] == wl}
        lines += [
            f"\n### {wl} (mean response {next(iter(rs.values()))['length']:.1f} tokens)\n",
            "| arm | wall s | samples/h | vs sync | bound | of bound | wait s | train s "
            "| sync s | fwd+bwd s | pi_j s | trainer idle | rollout idle | bottleneck busy "
            "| stale | fallback | load before/after |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in rs.items():
            loss = "ppo" if "-ppo" in name else "compis"
            sync = rs.get(f"sync-{loss}")
            bound = vs = of = float("nan")
            if sync is not None:
                tg, tt = sync["t_wait"], sync["t_train"] + sync["t_sync"]
                bound = (tg + tt) / max(tg, tt, 1e-9)
                vs = r["samples_per_hour"] / sync["samples_per_hour"]
                of = vs / bound
            lines.append(
                f"| {name} | {r['wall_s']:.0f} | {r['samples_per_hour']:.0f} | {vs:.2f}x | "
                f"{bound:.2f}x | {of:.0%} | {r['t_wait']:.3f} | {r['t_train']:.3f} | "
                f"{r['t_sync']:.3f} | {r['t_fwd_bwd']:.3f} | {r['t_behavior']:.3f} | "
                f"{r['idle_trainer']:.2f} | {r['idle_rollout']:.2f} | "
                f"{max(1 - r['idle_trainer'], 1 - r['idle_rollout']):.2f} | {r['staleness']:.1f} | "
                f"{r['fallback']:.2f} | {r['load_before']} / {r['load_after']} |"
            )
        sweep = sorted({int(n.rsplit("-S", 1)[1]) for n in rs if "-S" in n})
        for s in sweep:
            ppo = rs.get(f"async-ppo-S{s}")
            if ppo is None:
                continue
            for kind in ("async-compis", "async-compis-trainer"):
                c = rs.get(f"{kind}-S{s}")
                if c is not None:
                    # load-normalized: each arm's step in units of its own fwd+bwd (measured in
                    # the same steps, under the same load), CompIS over PPO
                    rel_c = c["t_train"] / max(c["t_fwd_bwd"], 1e-9)
                    rel_p = ppo["t_train"] / max(ppo["t_fwd_bwd"], 1e-9)
                    lines.append(
                        f"\nS={s}: {kind} train step {c['t_train']:.3f} s vs plain PPO "
                        f"{ppo['t_train']:.3f} s = {c['t_train'] / max(ppo['t_train'], 1e-9):.2f}x "
                        f"raw, {rel_c / rel_p:.2f}x load-normalized (step / own fwd+bwd: "
                        f"{rel_c:.2f} vs {rel_p:.2f}; pi_j^Meg in the step {c['t_behavior']:.3f} s, "
                        f"{c['behavior_forwards']:.1f} snapshot passes; "
                        f"throughput {c['samples_per_hour'] / ppo['samples_per_hour']:.2f}x PPO's)"
                    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench_out/async", help="Output directory.")
    p.add_argument("--num-steps", type=int, default=30, help="Train steps per arm.")
    p.add_argument(
        "--rollout-batch-size", type=int, default=4, help="Prompts per step (x 8 samples)."
    )
    p.add_argument("--seed", type=int, default=1, help="Seed shared by every arm.")
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument(
        "--staleness",
        nargs="*",
        type=int,
        default=[2],
        help="S of the async arms (the first also gets sync/one-step; the rest "
        "compare CompIS's step time with PPO's).",
    )
    p.add_argument(
        "--arms",
        nargs="*",
        default=None,
        help="Only these arm names, run in this order (e.g. interleaved).",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="Only summarize the arms already run under --out.",
    )
    p.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="Flags passed to every train_async.py run.",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    for wl in args.workloads:
        (out / wl).mkdir(parents=True, exist_ok=True)
    common = [
        "--num-steps",
        str(args.num_steps),
        "--seed",
        str(args.seed),
        "--rollout-batch-size",
        str(args.rollout_batch_size),
        "--micro-batch-size",
        "16",
        "--eval-interval",
        "0",
        *args.extra,
    ]

    from slime_async.orchestrator.warmstart import WarmStartConfig, warm_start
    from slime_async.rollout.data.tasks import TaskFamilyConfig

    ws = warm_start(
        out, config=WarmStartConfig(seed=args.seed), task=TaskFamilyConfig(seed=args.seed)
    )
    results = []
    if args.report_only:  # re-read finished arms (e.g. of an interrupted run)
        for wl in args.workloads:
            for name in arms(args.staleness):
                d = out / wl / name
                wanted = args.arms is None or name in args.arms
                if not (wanted and (d / "metrics.jsonl").exists()):
                    continue
                if any("train/version" in r for r in read_jsonl(d / "metrics.jsonl")):
                    results.append(summarize(wl, name, d, wall=float("nan"), before="?", after="?"))
        table = report(results)
        print(table)
        return 0
    for wl in args.workloads:
        warm = [] if "--warmstart-steps" in WORKLOADS[wl] else ["--hf-checkpoint", str(ws.path)]
        table_of = arms(args.staleness)
        for name in args.arms or list(table_of):  # in the order given
            results.append(run_arm(wl, name, [*warm, *table_of[name]], out, common))
    table = report(results)
    (out / "bench_async.md").write_text(table + "\n")
    (out / "bench_async.json").write_text(json.dumps(results, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
