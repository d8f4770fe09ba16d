"""Two pipelines of the embedded default: shared under the pipeline scheduler vs exclusive.

Arms (same flags, same seed, `--num-steps` each, one Ray node in this process):

  exclusive  pipeline a to completion, then pipeline b (one after another, each owning its
             engine; no scheduler)
  shared     a and b side by side, their engines on one slot of a pipeline scheduler (each
             serves only while the slot is granted, sleeps at level 2 otherwise)

Runs use the random-init tiny model (`--warmstart-steps 0`), 32-token answers, no eval.
Per arm: wall time from the first run's start to the last run's end (start-ups included: they
overlap in the shared arm), the trained samples of both pipelines together and the aggregate
samples/s; per pipeline its steady samples/s (trained samples over the sum of its step times),
its mean reward and its final loss; for the shared arm the scheduler's hand-overs. Writes
`bench_pipelines.json` into `--out`.

    nice -n 10 .venv/bin/python scripts/bench_pipelines.py --num-steps 8

`--learn` compares learning instead: each pipeline is the embedded default that learns (its warm
start, evals every `--eval-interval` steps; a and b differ by `--seed`), `--num-steps` each,
in three arms: `solo` (a, then b, each owning the machine: each pipeline's solo curve),
`shared` (side by side under the scheduler, one engine slot) and `split` (side by side, each
in its own process pinned to one core with `taskset`, owning its engine there). Per pipeline and
arm: the held-out eval (`eval/reward` with its standard error) at each eval step, that is at
equal trained samples; per arm the wall time and the aggregate trained samples/s. Writes
`bench_learn.json` into `--out`.

    nice -n 10 .venv/bin/python scripts/bench_pipelines.py --learn --num-steps 40

`--mechanism` measures instead what one switch of an engine slot costs, for the simulator
(`scripts/bench_sim_pipelines.py`): one embedded engine with ~250 MB of fp32 weights, level-2
sleep and wake `--repeats` times (the engine's own `release_s` / `resume_s` and bytes, from
`/server_info`), against the memcpy bound (one thread copying 256 MiB, best of 5) measured in
the same run; prints seconds per GB of weights.

    nice -n 10 .venv/bin/python scripts/bench_pipelines.py --mechanism
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from slime_async.config import parse_config
from slime_async.config.pipeline import PipelineSchedulerConfig
from slime_async.orchestrator.controller import train
from slime_async.orchestrator.pipeline_scheduler import start_scheduler
from slime_async.orchestrator.roles import init_ray


def _argv(run_dir: Path, steps: int, name: str | None) -> list[str]:
    argv = ["--run-dir", str(run_dir), "--num-steps", str(steps), "--max-staleness", "1"]
    argv += ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]
    # the random-init tiny model, short answers: the mechanism's costs, not a learning curve
    argv += ["--warmstart-steps", "0", "--eval-interval", "0", "--rollout-max-response-len", "32"]
    if name is not None:
        argv += ["--pipeline-scheduler", "bench-pool", "--pipeline-name", name]
    return argv


def _pipeline_numbers(run_dir: Path, summary: dict) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/version" in r]
    samples = sum(r.get("rollout/samples", 0) or 0 for r in rows)
    step_s = sum(r.get("timing/step_s", 0.0) for r in rows)
    trained = len(rows) * 16  # rollout-batch-size 4 x n-samples-per-prompt 4
    return {
        "steps": len(rows),
        "trained_samples": trained,
        "steady_samples_per_s": trained / step_s if step_s else 0.0,
        "reward_mean": sum(r.get("rollout/reward_mean", 0.0) for r in rows) / max(1, len(rows)),
        "final_loss": summary.get("loss/total"),
        "rollout_samples_logged": samples,
    }


async def _exclusive(out: Path, steps: int) -> dict:
    t0 = time.perf_counter()
    per = {}
    for name in ("a", "b"):
        d = out / "exclusive" / name
        per[name] = _pipeline_numbers(d, await train(parse_config(_argv(d, steps, None))))
    wall = time.perf_counter() - t0
    total = sum(p["trained_samples"] for p in per.values())
    return {"wall_s": wall, "samples": total, "samples_per_s": total / wall, "pipelines": per}


async def _shared(out: Path, steps: int) -> dict:
    sched = start_scheduler("bench-pool", PipelineSchedulerConfig(slots=1, min_hold_s=1.0))
    t0 = time.perf_counter()
    dirs = {n: out / "shared" / n for n in ("a", "b")}
    sums = await asyncio.gather(*(train(parse_config(_argv(d, steps, n))) for n, d in dirs.items()))
    wall = time.perf_counter() - t0
    state = await sched.state.remote()
    import ray

    ray.kill(sched)
    per = {n: _pipeline_numbers(d, s) for (n, d), s in zip(dirs.items(), sums)}
    total = sum(p["trained_samples"] for p in per.values())
    handovers = sum("released" in e[2] for e in state["events"])
    return {
        "wall_s": wall,
        "samples": total,
        "samples_per_s": total / wall,
        "handovers": handovers,
        "pipelines": per,
    }


LEARN_SEEDS = {"a": 1, "b": 2}


def _learn_argv(run_dir: Path, steps: int, seed: int, eval_every: int) -> list[str]:
    """The embedded default as it learns (warm start and eval at their defaults but the
    interval), `steps` steps, one seed per pipeline."""
    return ["--run-dir", str(run_dir), "--num-steps", str(steps), "--seed", str(seed),
            "--eval-interval", str(eval_every)]  # fmt: skip


def _curve(run_dir: Path) -> dict:
    """Held-out eval by step, and the run's trained samples and step seconds."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {
        int(r["step"]): (r["eval/reward"], r.get("eval/reward_se"))
        for r in rows
        if "eval/reward" in r
    }
    steps = [r for r in rows if "train/version" in r]
    ledger = (run_dir / "trained.jsonl").read_text().splitlines()
    trained = sum(len(g["groups"]) for g in map(json.loads, ledger))
    return {
        "eval": evals,
        "steps": len(steps),
        "trained_groups": trained,
        "step_s": sum(r.get("timing/step_s", 0.0) for r in steps),
    }


async def _learn_solo(out: Path, steps: int, every: int) -> dict:
    t0, per = time.perf_counter(), {}
    for name, seed in LEARN_SEEDS.items():
        d = out / "solo" / name
        await train(parse_config(_learn_argv(d, steps, seed, every)))
        per[name] = _curve(d)
    return {"wall_s": time.perf_counter() - t0, "pipelines": per}


async def _learn_shared(out: Path, steps: int, every: int) -> dict:
    import ray

    cfg = PipelineSchedulerConfig(slots=1, min_hold_s=1.0, min_pipelines=2)
    sched = start_scheduler("bench-learn", cfg)
    t0 = time.perf_counter()
    dirs = {n: out / "shared" / n for n in LEARN_SEEDS}
    extra = ["--pipeline-scheduler", "bench-learn", "--pipeline-name"]
    await asyncio.gather(
        *(
            train(parse_config([*_learn_argv(d, steps, LEARN_SEEDS[n], every), *extra, n]))
            for n, d in dirs.items()
        )
    )
    wall = time.perf_counter() - t0
    state = await sched.state.remote()
    ray.kill(sched)
    per = {n: _curve(d) for n, d in dirs.items()}
    handovers = sum("released" in e[2] for e in state["events"])
    return {"wall_s": wall, "pipelines": per, "handovers": handovers}


def _learn_split(out: Path, steps: int, every: int) -> dict:
    """a on core 0, b on core 1: two processes (each its own Ray node), side by side."""
    root = Path(__file__).resolve().parents[1]
    t0, procs = time.perf_counter(), {}
    for core, (name, seed) in enumerate(LEARN_SEEDS.items()):
        d = out / "split" / name
        d.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["taskset", "-c", str(core), sys.executable, str(root / "train_async.py")]
        log = open(out / "split" / f"{name}.log", "w")  # noqa: SIM115 (closed below)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        argv = [*cmd, *_learn_argv(d, steps, seed, every)]
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
        procs[name] = (proc, log)
    for name, (proc, log) in procs.items():
        if proc.wait() != 0:
            raise RuntimeError(f"split arm: pipeline {name} exited {proc.returncode}: {log.name}")
        log.close()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "pipelines": {n: _curve(out / "split" / n) for n in procs}}


def learn(out: Path, steps: int, every: int, arms: list[str]) -> dict:
    res: dict = {}
    for arm in arms:
        t = time.perf_counter()
        if arm == "split":
            res[arm] = _learn_split(out, steps, every)
        else:
            init_ray(num_cpus=8)
            fn = _learn_solo if arm == "solo" else _learn_shared
            res[arm] = asyncio.run(fn(out, steps, every))
        groups = sum(p["trained_groups"] for p in res[arm]["pipelines"].values())
        res[arm]["trained_groups"] = groups
        res[arm]["groups_per_s"] = groups / res[arm]["wall_s"]
        res[arm]["load_avg_after"] = os.getloadavg()
        print(f"{arm}: {time.perf_counter() - t:.0f} s, load {os.getloadavg()}", flush=True)
        (out / "bench_learn.json").write_text(json.dumps(res, indent=2))  # arm by arm
    return res


def _memcpy_s_per_gb() -> float:
    import torch

    src = torch.ones(256 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return best / (src.numel() / 1e9)


async def _sleep_wake(url: str, repeats: int) -> list[dict]:
    import aiohttp

    from slime_async.engine.testing import post

    rows = []
    async with aiohttp.ClientSession() as s:
        for _ in range(repeats):
            st, _res = await post(s, url + "/release_memory_occupation", {"tags": None})
            st2, _res = await post(s, url + "/resume_memory_occupation", {})
            assert (st, st2) == (200, 200), (st, st2)
            async with s.get(url + "/server_info") as r:
                rows.append((await r.json())["internal_states"][0]["memory"])
    return rows


def mechanism(repeats: int, out: Path) -> dict:
    """Level-2 sleep and wake seconds per GB of one embedded engine, and the memcpy bound."""
    import dataclasses as dc
    import statistics

    from slime_async.contracts.model import TINY_MOE
    from slime_async.engine import EngineConfig, EngineProcess

    spec = dc.replace(TINY_MOE, vocab_size=32768, hidden_size=768, intermediate_size=1536)
    cfg = EngineConfig(dtype="fp32", model_spec=spec.to_dict(), num_threads=1)
    proc = EngineProcess(cfg, log_path=str(out / "engine.log"))
    url = proc.start()
    try:
        memcpy_before = _memcpy_s_per_gb()
        rows = asyncio.run(_sleep_wake(url, repeats))
        memcpy = min(memcpy_before, _memcpy_s_per_gb())
    finally:
        proc.stop()
    gb = rows[0]["weights_bytes"] / 1e9
    sleep = [r["release_s"] / gb for r in rows]
    wake = [r["resume_s"] / gb for r in rows]
    return {
        "weights_gb": gb,
        "sleep_s_per_gb": sleep,
        "wake_s_per_gb": wake,
        "sleep_s_per_gb_median": statistics.median(sleep),
        "wake_s_per_gb_median": statistics.median(wake),
        "memcpy_s_per_gb": memcpy,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-steps", type=int, default=8)
    ap.add_argument("--out", default="/tmp/bench_pipelines")
    ap.add_argument("--mechanism", action="store_true", help="sleep/wake s/GB and memcpy only")
    ap.add_argument("--repeats", type=int, default=5, help="sleep/wake pairs (--mechanism)")
    ap.add_argument("--learn", action="store_true", help="learning curves: solo, shared, split")
    ap.add_argument("--eval-interval", type=int, default=10, help="steps between evals (--learn)")
    ap.add_argument("--arms", default="solo,shared,split", help="arms of --learn")
    args = ap.parse_args()
    if args.learn:
        out = Path(args.out)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        res = learn(out, args.num_steps, args.eval_interval, args.arms.split(","))
        (out / "bench_learn.json").write_text(json.dumps(res, indent=2))
        print(json.dumps(res, indent=2))
        return
    if args.mechanism:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(mechanism(args.repeats, out), indent=2))
        return
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    init_ray(num_cpus=8)
    res = {
        "exclusive": asyncio.run(_exclusive(out, args.num_steps)),
        "shared": asyncio.run(_shared(out, args.num_steps)),
    }
    res["speedup"] = res["shared"]["samples_per_s"] / res["exclusive"]["samples_per_s"]
    (out / "bench_pipelines.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
