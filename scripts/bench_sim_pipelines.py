"""Many pipelines on one pool at cluster scale, simulated: exclusive allocation vs the pipeline
scheduler's demand-driven time-sharing, in one run (`simulate_pipelines.py`: the real data
worker per pipeline and the real `SchedulerCore` in virtual time).

Default: 4 pipelines on 64 accelerators (4 trainer devices each, 48 engine slots of 32
concurrent requests), agentic long tails (responses 5k-30k tokens, heavy-tailed), near
on-policy (`--max-staleness 1`), train steps of 60-240 s (one per pipeline, cycled). The
mechanism's costs per switch come from `--model-gb` times the measured seconds per GB:
sleep (level 2: the weights out) and wake (back) from `scripts/bench_pipelines.py
--mechanism`, the selective sync from the weight-sync results page; the model size is assumed.
Prints per-arm numbers and the shared/exclusive ratios: aggregate rollout samples/s, train
steps/s, trained samples/s, Jain's index of the engine-slot time granted, the accelerators'
idle and switching fractions. Results: docs/results/2026-11-27-pipelines-sim.md.

    nice -n 10 .venv/bin/python scripts/bench_sim_pipelines.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulate_dispatch as sd
from simulate_pipelines import PoolConfig, PoolResult, simulate_pool

# Seconds per GB measured on the 2-core CPU machine (docs/results/2026-11-27-pipelines-sim.md
# says which run): level-2 sleep and wake of the embedded engine (`bench_pipelines.py
# --mechanism`), and a weight push into an engine (the median distributed sync of SmolLM2-135M,
# 0.269 s for 0.269 GB, docs/results/2026-11-27-weight-sync-floor.md).
SLEEP_S_PER_GB = 1.53
WAKE_S_PER_GB = 1.33
SYNC_S_PER_GB = 1.0


def jain(xs: list[float]) -> float:
    """Jain's fairness index of `xs`: 1 when all equal, 1/n when one has everything (nan when
    all are 0).

    >>> jain([1.0, 1.0, 1.0, 1.0]), jain([1.0, 0.0, 0.0, 0.0])
    (1.0, 0.25)
    """
    s, q = sum(xs), sum(x * x for x in xs)
    return s * s / (len(xs) * q) if q > 0 else float("nan")  # nothing granted at all


def metrics(r: PoolResult, engine_slots: int) -> dict[str, float]:
    """The arm's aggregate numbers (per simulated second; fractions of accelerator time)."""
    t, acc = r.sim_s, r.accelerators
    grants = [p.granted_s for p in r.pipes]
    return {
        "rollout samples/s": sum(p.rollout_samples for p in r.pipes) / t,
        "train steps/s": sum(p.steps for p in r.pipes) / t,
        "trained samples/s": sum(p.trained_samples for p in r.pipes) / t,
        "grant Jain": jain(grants),
        "steps Jain": jain([float(p.steps) for p in r.pipes]),
        "fewest steps": float(min(p.steps for p in r.pipes)),
        "idle fraction": 1.0 - (r.engine_busy_s + r.trainer_busy_s) / (acc * t),
        "switching fraction": r.engine_switch_s / (acc * t),
        "engine occupancy": r.occupied_s / (engine_slots * t),
        "requests cut": float(r.preempted),
        "hand-overs": float(sum(p.switches for p in r.pipes)),
        "pipelines dropped": float(sum(p.dropped_at is not None for p in r.pipes)),
    }


def table(ex: dict[str, float], sh: dict[str, float]) -> str:
    rows = ["| metric | exclusive | shared | shared / exclusive |", "|---|---|---|---|"]
    for k in ex:
        ratio = sh[k] / ex[k] if ex[k] else float("nan")
        rows.append(f"| {k} | {ex[k]:.4g} | {sh[k]:.4g} | {ratio:.3f} |")
    return "\n".join(rows)


def per_pipeline(results: list[PoolResult], cfgs: list[sd.SimConfig]) -> str:
    rows = ["| pipeline | train step s | arm | steps | rollout samples | granted slot-h |"]
    rows.append("|---|---|---|---|---|---|")
    for r in results:
        for p, c in zip(r.pipes, cfgs):
            rows.append(
                f"| {p.name} | {c.train_step_s:g} | {r.arm} | {p.steps} | {p.rollout_samples} "
                f"| {p.granted_s / 3600:.1f} |"
            )
    return "\n".join(rows)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--pipelines", type=int, default=4, help="pipelines sharing the pool")
    a("--accelerators", type=int, default=64, help="accelerators in the pool")
    a("--trainer-devices", type=int, default=4, help="accelerators per pipeline's trainer")
    a("--slots", type=int, default=32, help="concurrent requests per engine")
    a("--n", type=int, default=8, help="samples per prompt")
    a("--groups-per-step", type=int, default=32, help="B per pipeline")
    a("--max-staleness", type=int, default=1, help="S per pipeline")
    a("--train-step-s", default="60,120,180,240", help="trainer s/step, cycled over pipelines")
    a("--min-len", type=int, default=5_000, help="shortest response (tokens)")
    a("--max-len", type=int, default=30_000, help="longest response (tokens)")
    a("--prompts", type=int, default=4_000, help="prompts per pipeline")
    a("--horizon-h", type=float, default=6.0, help="simulated hours per arm")
    a("--heartbeat-s", type=float, default=0.5, help="seconds between demand reports")
    a("--min-hold-s", type=float, default=2.0, help="the scheduler's min_hold_s")
    a("--heartbeat-timeout-s", type=float, default=10.0, help="the scheduler's drop timeout")
    a("--model-gb", type=float, default=16.0, help="weights per engine, GB (assumed: 8B bf16)")
    a("--sleep-s-per-gb", type=float, default=SLEEP_S_PER_GB, help="level-2 sleep, s/GB")
    a("--wake-s-per-gb", type=float, default=WAKE_S_PER_GB, help="wake, s/GB")
    a("--sync-s-per-gb", type=float, default=SYNC_S_PER_GB, help="selective sync, s/GB")
    return p.parse_args()


def main() -> None:
    a = _parse()
    engine_slots = a.accelerators - a.pipelines * a.trainer_devices
    if engine_slots < a.pipelines:
        sys.exit(
            f"--accelerators {a.accelerators} leaves {engine_slots} engine slots after "
            f"{a.pipelines} x --trainer-devices {a.trainer_devices}: give more accelerators"
        )
    steps_s = [float(x) for x in a.train_step_s.split(",") if x]
    pool = PoolConfig(
        engine_slots=engine_slots,
        trainer_devices=a.trainer_devices,
        heartbeat_s=a.heartbeat_s,
        min_hold_s=a.min_hold_s,
        heartbeat_timeout_s=a.heartbeat_timeout_s,
        sleep_s=a.sleep_s_per_gb * a.model_gb,
        wake_s=a.wake_s_per_gb * a.model_gb,
        sync_s=a.sync_s_per_gb * a.model_gb,
        horizon_s=a.horizon_h * 3600,
    )
    base = sd.SimConfig(
        engines=engine_slots // a.pipelines,
        slots=a.slots,
        prompts=a.prompts,
        min_len=a.min_len,
        max_len=a.max_len,
        n=a.n,
        groups_per_step=a.groups_per_step,
        max_staleness=a.max_staleness,
        max_off_policy_steps=None,
        steps=10**9,
    )
    cfgs = [
        dataclasses.replace(base, seed=i, train_step_s=steps_s[i % len(steps_s)])
        for i in range(a.pipelines)
    ]
    results = []
    for arm in ("exclusive", "shared"):
        t = time.perf_counter()
        results.append(simulate_pool(arm, pool, cfgs))
        print(f"  {arm}: {a.horizon_h:g} simulated h in {time.perf_counter() - t:.1f} s wall")
    ex, sh = (metrics(r, engine_slots) for r in results)
    print(
        f"\n{a.pipelines} pipelines, {a.accelerators} accelerators ({engine_slots} engine slots "
        f"x {a.slots} requests, {a.trainer_devices} trainer devices each); switch costs: sleep "
        f"{pool.sleep_s:.1f} s, wake {pool.wake_s:.1f} s, sync {pool.sync_s:.1f} s; heartbeat "
        f"{pool.heartbeat_s:g} s, min_hold {pool.min_hold_s:g} s\n"
    )
    print(table(ex, sh))
    print()
    print(per_pipeline(results, cfgs))


if __name__ == "__main__":
    main()
