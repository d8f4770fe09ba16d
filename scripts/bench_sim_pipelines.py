"""Many pipelines on one pool at cluster scale, simulated: exclusive allocation vs the pipeline
scheduler's demand-driven time-sharing, in one run (`simulate_pipelines.py`: the real data
worker per pipeline and the real `SchedulerCore` in virtual time).

Default: 4 pipelines on 64 accelerators (4 trainer devices each, 48 engine slots of 32
concurrent requests), agentic long tails (responses 5k-30k tokens, heavy-tailed), near
on-policy (`--max-staleness 1`), train steps of 60-240 s. The per-pipeline flags
(`--train-step-s`, `--max-staleness`, `--groups-per-step`, `--min-len`, `--max-len`) take a
comma list, cycled over the pipelines, so one pool can mix synchronous (S 0) and async,
training- and generation-bound, short-answer and long-tail pipelines.

Arms (`--arms`, in one run, the same pipelines and pool each):
  exclusive   each pipeline owns an equal share of the engine slots (its solo run)
  shared      the scheduler time-shares every slot, grants capped by demand
  spread      shared, and the slots nobody needs are lent (`PipelineSchedulerConfig.spread`)
  sustained   shared with sustained demand (`--demand-window-s`, `PipelineSchedulerConfig.
              demand_window_s`): claims sized by each pipeline's averaged need, busy slots
              taken only for a claim (every other arm runs the instant rule, as the results
              pages before it did)
  sustained-spread  sustained, and a pipeline's instant need is at least its share while its
              requests could spread over it (`spread`)
  split       a static split sized to demand: each pipeline owns the slots in proportion to
              the slot time it was granted in the `spread` (else `shared`) arm
  sequential  one after another: each pipeline alone on every engine slot for 1/P of the time
  ex-overlap  exclusive, and each pipeline's own trainer devices serve its generation between
              its train steps (partial overlap, `PipelineSchedulerConfig.trainer_slots`)
  overlap     shared, and every trainer device serves generation between its pipeline's
              train steps (its own pipeline first, the others' too: `overlap_others`)
  overlap-own shared, a trainer device serving only its own pipeline between its steps

With overlap, the engines on a trainer's devices are cut and put to sleep before each of its
steps, its state (`--trainer-gb` per device) is swapped onto them and off again after the step
at the switch costs' rate, and a woken engine there gets the version (selective sync).

Switch costs (`--costs`): `measured` (CPU: `--model-gb` times the seconds per GB measured by
`scripts/bench_pipelines.py --mechanism` and the weight-sync results page), `gpu` (assumed:
`GPU_COSTS`, from PCIe and NCCL bandwidths), `free`. Prints per-arm numbers and their ratios to
`exclusive` (aggregate rollout samples/s, train steps/s, trained samples/s, Jain's index of the
slot time granted, idle and switching fractions) and each pipeline's trained samples/s against
its solo run. Results: docs/results/2026-11-27-pipelines-sim.md.

    nice -n 10 .venv/bin/python scripts/bench_sim_pipelines.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulate_dispatch as sd
from simulate_pipelines import PoolConfig, PoolResult, simulate_pool

from slime_async.config.pipeline import DEMAND_WINDOW_S, ROTATION_QUANTUM

# Seconds per GB measured on the 2-core CPU machine (docs/results/2026-11-27-pipelines-sim.md
# says which run): level-2 sleep and wake of the embedded engine (`bench_pipelines.py
# --mechanism`), and a weight push into an engine (the median distributed sync of SmolLM2-135M,
# 0.269 s for 0.269 GB, docs/results/2026-11-27-weight-sync-floor.md).
SLEEP_S_PER_GB = 1.53
WAKE_S_PER_GB = 1.33
SYNC_S_PER_GB = 1.0

GPU_COSTS = {"sleep": (0.04, 1.0), "wake": (0.04, 1.0), "sync": (0.1, 1.0)}
"""Assumed GPU switch costs, (s per GB of weights, s fixed): a level-2 sleep of an SGLang
engine under torch_memory_saver copies its weights to pinned host memory (PCIe 4.0 x16, ~25
GB/s: 0.04 s/GB) and unmaps the KV cache (its virtual addresses, so the CUDA graphs, are kept);
wake copies them back; the selective sync of the new version is a broadcast over NCCL at ~10
GB/s (0.1 s/GB); 1 s each for the process-level work (abort, flush, resume calls). Not
measured here (no GPU): a 7B model in bf16 (14 GB) gives sleep 1.6 s, wake 1.6 s, sync 2.4 s."""


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
        "engine occupancy": r.occupied_s / ((r.engine_slots or engine_slots) * t),
        "requests cut": float(r.preempted),
        "hand-overs": float(sum(p.switches for p in r.pipes)),
        "pipelines dropped": float(sum(p.dropped_at is not None for p in r.pipes)),
        "trainer wait s/step": sum(p.trainer_wait_s for p in r.pipes)
        / max(1, sum(p.steps for p in r.pipes)),
    }


def rates(r: PoolResult) -> list[float]:
    """Each pipeline's trained samples per simulated second while it ran (sequential: its turn)."""
    turn = r.sim_s / len(r.pipes) if r.arm == "sequential" else r.sim_s
    return [p.trained_samples / turn for p in r.pipes]


def table(results: dict[str, dict[str, float]]) -> str:
    arms = list(results)
    head = "| metric | " + " | ".join(arms) + " | " + " | ".join(f"{a} / ex" for a in arms[1:])
    rows = [head + " |", "|---" * (2 * len(arms)) + "|"]
    ex = results["exclusive"]
    for k in ex:
        vals = [f"{results[a][k]:.4g}" for a in arms]
        ratios = [f"{results[a][k] / ex[k]:.3f}" if ex[k] else "nan" for a in arms[1:]]
        rows.append(f"| {k} | " + " | ".join(vals + ratios) + " |")
    return "\n".join(rows)


def per_pipeline(results: list[PoolResult], cfgs: list[sd.SimConfig]) -> str:
    """Each pipeline's trained samples/s per arm, and against its solo run (`exclusive`)."""
    solo = rates(results[0])
    rows = ["| pipeline | S | B | train step s | lengths | arm | steps | trained samples/s "
            "| vs solo | granted slot-h |", "|---" * 10 + "|"]  # fmt: skip
    for r in results:
        for p, c, x, s in zip(r.pipes, cfgs, rates(r), solo):
            rows.append(
                f"| {p.name} | {c.max_staleness} | {c.groups_per_step} | {c.train_step_s:g} "
                f"| {c.min_len}-{c.max_len} | {r.arm} | {p.steps} | {x:.3f} "
                f"| {x / s if s else float('nan'):.3f} | {p.granted_s / 3600:.1f} |"
            )
    return "\n".join(rows)


def split_shares(r: PoolResult, engine_slots: int) -> tuple[int, ...]:
    """A static split in proportion to the slot time each pipeline was granted in `r` (at least
    one slot each; largest remainders get the rest)."""
    g = [max(p.granted_s, 1e-9) for p in r.pipes]
    room = engine_slots - len(g)
    raw = [room * x / sum(g) for x in g]
    shares = [1 + int(x) for x in raw]
    for i in sorted(range(len(g)), key=lambda i: int(raw[i]) - raw[i])[
        : engine_slots - sum(shares)
    ]:
        shares[i] += 1
    return tuple(shares)


def sequential(pool: PoolConfig, cfgs: list[sd.SimConfig]) -> PoolResult:
    """One after another: each pipeline alone on every engine slot for 1/P of the horizon."""
    assert pool.horizon_s is not None
    turn = dataclasses.replace(pool, horizon_s=pool.horizon_s / len(cfgs), shares=None)
    alone = [simulate_pool("exclusive", turn, [c]) for c in cfgs]
    pipes = []
    for r, name in zip(alone, "abcdefghijklmnopqrstuvwxyz"):
        r.pipes[0].name = name
        pipes.append(r.pipes[0])
    return PoolResult(
        arm="sequential",
        sim_s=pool.horizon_s,
        pipes=pipes,
        accelerators=pool.engine_slots + pool.trainer_devices * len(cfgs),
        engine_busy_s=sum(r.engine_busy_s for r in alone),
        engine_switch_s=0.0,
        occupied_s=sum(r.occupied_s for r in alone),
        trainer_busy_s=sum(r.trainer_busy_s for r in alone),
        preempted=0,
    )


def _cycled(text: str, kind: type) -> list:
    return [kind(x) for x in text.split(",") if x]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--pipelines", type=int, default=4, help="pipelines sharing the pool")
    a("--accelerators", type=int, default=64, help="accelerators in the pool")
    a("--trainer-devices", type=int, default=4, help="accelerators per pipeline's trainer")
    a("--slots", type=int, default=32, help="concurrent requests per engine")
    a("--n", type=int, default=8, help="samples per prompt")
    a("--groups-per-step", default="32", help="B per pipeline (list, cycled)")
    a("--max-staleness", default="1", help="S per pipeline, 0: synchronous (list, cycled)")
    a("--train-step-s", default="60,120,180,240", help="trainer s/step (list, cycled)")
    a("--min-len", default="5000", help="shortest response, tokens (list, cycled)")
    a("--max-len", default="30000", help="longest response, tokens (list, cycled)")
    a("--prompts", type=int, default=4_000, help="prompts per pipeline")
    a("--horizon-h", type=float, default=6.0, help="simulated hours per arm")
    a("--heartbeat-s", type=float, default=0.5, help="seconds between demand reports")
    a("--min-hold-s", type=float, default=2.0, help="the scheduler's min_hold_s")
    a("--heartbeat-timeout-s", type=float, default=10.0, help="the scheduler's drop timeout")
    a("--drain-timeout-s", type=float, default=60.0, help="the scheduler's drain_timeout_s")
    a("--priority", default="1", help="each pipeline's priority (list, cycled)")
    a("--keep-partial", action="store_true", help="what-if, not built: cut requests go on")
    a("--model-gb", type=float, default=16.0, help="weights per engine, GB (assumed: 8B bf16)")
    a("--costs", choices=("measured", "gpu", "free"), default="measured", help="switch costs")
    a("--sleep-s-per-gb", type=float, default=SLEEP_S_PER_GB, help="level-2 sleep, s/GB")
    a("--wake-s-per-gb", type=float, default=WAKE_S_PER_GB, help="wake, s/GB")
    a("--sync-s-per-gb", type=float, default=SYNC_S_PER_GB, help="selective sync, s/GB")
    a("--trainer-gb", type=float, default=None,
      help="overlap: trainer state per trainer device, GB (default: 8 x --model-gb / "
           "--trainer-devices, i.e. 16 bytes a parameter: bf16 weights and grads, fp32 master "
           "weights and Adam moments)")  # fmt: skip
    a("--overlap-spread", action="store_true",
      help="the overlap arms with `spread` (slots nobody needs lent to spread requests)")  # fmt: skip
    a("--demand-window-s", type=float, default=DEMAND_WINDOW_S,
      help="the sustained arms' demand_window_s (the other arms: 0, the instant rule)")  # fmt: skip
    a("--rotation-quantum", type=float, default=ROTATION_QUANTUM,
      help="the scheduler's rotation_quantum in every shared arm (0: min_hold_s alone)")  # fmt: skip
    a("--arms", default="exclusive,shared,spread,split", help="arms to run (exclusive first)")
    a("--json", default=None, help="also write the numbers to this file")
    return p.parse_args()


def switch_costs(a: argparse.Namespace) -> tuple[float, float, float]:
    """Seconds per switch of one slot: sleep, wake, selective sync."""
    if a.costs == "free":
        return 0.0, 0.0, 0.0
    if a.costs == "gpu":
        return tuple(per_gb * a.model_gb + fixed for per_gb, fixed in GPU_COSTS.values())
    return (a.sleep_s_per_gb * a.model_gb, a.wake_s_per_gb * a.model_gb,
            a.sync_s_per_gb * a.model_gb)  # fmt: skip


def trainer_swap_s(a: argparse.Namespace) -> float:
    """Overlap: seconds to move a trainer's state onto its devices (or off them), each way: its
    `--trainer-gb` at the level-2 sleep's rate (a copy to or from host memory)."""
    gb = a.trainer_gb if a.trainer_gb is not None else 8 * a.model_gb / a.trainer_devices
    if a.costs == "free":
        return 0.0
    if a.costs == "gpu":
        per_gb, fixed = GPU_COSTS["sleep"]
        return per_gb * gb + fixed
    return a.sleep_s_per_gb * gb


def configs(a: argparse.Namespace, engine_slots: int) -> list[sd.SimConfig]:
    """One `SimConfig` per pipeline (the per-pipeline lists cycled)."""
    lists = {
        "train_step_s": _cycled(a.train_step_s, float),
        "max_staleness": _cycled(a.max_staleness, int),
        "groups_per_step": _cycled(a.groups_per_step, int),
        "min_len": _cycled(a.min_len, int),
        "max_len": _cycled(a.max_len, int),
    }
    base = sd.SimConfig(
        engines=engine_slots // a.pipelines, slots=a.slots, prompts=a.prompts, n=a.n,
        max_off_policy_steps=None, steps=10**9,
    )  # fmt: skip
    return [
        dataclasses.replace(base, seed=i, **{k: v[i % len(v)] for k, v in lists.items()})
        for i in range(a.pipelines)
    ]


OVERLAP_ARMS = {
    "ex-overlap": ("exclusive", False),
    "overlap": ("shared", True),
    "overlap-own": ("shared", False),
}
"""Arms with partial overlap: (the arm it extends, other pipelines served on a trainer slot)."""


def run_arms(a: argparse.Namespace, pool: PoolConfig, cfgs: list[sd.SimConfig]) -> list:
    arms = _cycled(a.arms, str)
    if arms[0] != "exclusive":
        sys.exit("--arms must begin with exclusive (the ratios are to it)")
    results: list[PoolResult] = []
    for arm in arms:
        t = time.perf_counter()
        if arm == "sequential":
            results.append(sequential(pool, cfgs))
        elif arm == "split":
            src = next((r for r in results[::-1] if r.arm in ("spread", "shared")), None)
            if src is None:
                sys.exit("--arms: split needs a shared or spread arm before it")
            shares = split_shares(src, pool.engine_slots)
            r = simulate_pool("exclusive", dataclasses.replace(pool, shares=shares), cfgs)
            r.arm = f"split {'/'.join(map(str, shares))}"
            results.append(r)
        elif arm in ("exclusive", "shared", "spread", "sustained", "sustained-spread"):
            window = a.demand_window_s if arm.startswith("sustained") else 0.0
            cfg = dataclasses.replace(
                pool, spread=arm in ("spread", "sustained-spread"), demand_window_s=window
            )
            r = simulate_pool("exclusive" if arm == "exclusive" else "shared", cfg, cfgs)
            r.arm = arm
            results.append(r)
        elif arm in OVERLAP_ARMS:
            base, others = OVERLAP_ARMS[arm]
            cfg = dataclasses.replace(
                pool, overlap=True, overlap_others=others, spread=a.overlap_spread
            )
            r = simulate_pool(base, cfg, cfgs)
            r.arm = arm
            results.append(r)
        else:
            sys.exit(f"--arms: unknown arm {arm!r}")
        print(f"  {arm}: {a.horizon_h:g} simulated h in {time.perf_counter() - t:.1f} s wall")
    return results


def main() -> None:
    a = _parse()
    engine_slots = a.accelerators - a.pipelines * a.trainer_devices
    if engine_slots < a.pipelines:
        sys.exit(
            f"--accelerators {a.accelerators} leaves {engine_slots} engine slots after "
            f"{a.pipelines} x --trainer-devices {a.trainer_devices}: give more accelerators"
        )
    sleep_s, wake_s, sync_s = switch_costs(a)
    prio = _cycled(a.priority, float)
    pool = PoolConfig(
        engine_slots=engine_slots, trainer_devices=a.trainer_devices,
        heartbeat_s=a.heartbeat_s, min_hold_s=a.min_hold_s,
        heartbeat_timeout_s=a.heartbeat_timeout_s, drain_timeout_s=a.drain_timeout_s,
        sleep_s=sleep_s, wake_s=wake_s, sync_s=sync_s, horizon_s=a.horizon_h * 3600,
        priorities=tuple(prio[i % len(prio)] for i in range(a.pipelines)),
        keep_partial=a.keep_partial, trainer_swap_s=trainer_swap_s(a),
        demand_window_s=0.0,  # the instant rule, but in the sustained arms (as on the pages)
        rotation_quantum=a.rotation_quantum,
    )  # fmt: skip
    cfgs = configs(a, engine_slots)
    results = run_arms(a, pool, cfgs)
    numbers = {r.arm: metrics(r, engine_slots) for r in results}
    for r in results:
        solo = [x / s if s else float("nan") for x, s in zip(rates(r), rates(results[0]))]
        numbers[r.arm] |= {"slowest vs solo": min(solo), "fastest vs solo": max(solo)}
    print(
        f"\n{a.pipelines} pipelines, {a.accelerators} accelerators ({engine_slots} engine slots "
        f"x {a.slots} requests, {a.trainer_devices} trainer devices each); switch costs "
        f"({a.costs}): sleep {sleep_s:.1f} s, wake {wake_s:.1f} s, sync {sync_s:.1f} s; "
        f"heartbeat {pool.heartbeat_s:g} s, min_hold {pool.min_hold_s:g} s, rotation quantum "
        f"{pool.rotation_quantum:g} hand-overs, drain "
        f"{pool.drain_timeout_s:g} s; overlap arms: trainer swap {pool.trainer_swap_s:.1f} s "
        "each way\n"
    )
    print(table(numbers))
    print()
    print(per_pipeline(results, cfgs))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "arms": numbers}, indent=2))


if __name__ == "__main__":
    main()
