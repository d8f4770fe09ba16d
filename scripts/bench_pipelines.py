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
in up to four arms (`--arms`): `solo` (a, then b, each owning the machine: each pipeline's solo
curve), `shared` (side by side under the scheduler, one engine slot), `split` (side by side,
each in its own process pinned to one core with `taskset`, owning its engine there) and
`scheduled` (side by side under the scheduler with a pool of two slots, one per core: each
pipeline has an engine on each core (`--num-engines 2 --rollout-cores 0,1`) and its trainer on
its own core (a: 0, b: 1, `--trainer-cores`), that core's slot its trainer slot
(`trainer_slots`, partial overlap: the engine there generates between its own train steps and
sleeps at level 1 through each), `overlap_others` so that the slot a pipeline leaves (done or
crashed) is granted to the other). Per pipeline and arm: the held-out eval (`eval/reward` with
its standard error) at each eval step, that is at equal trained samples, its wall time and
samples/s (trained samples over its own wall time, start-up included); per arm the wall time,
the aggregate trained samples/s and its ratio to `solo`'s (when `solo` ran in the same
invocation), the scheduler's hand-overs (a slot granted to another pipeline than its last
holder) and, for `scheduled`, the trainer-step sleeps of each pipeline's own engine and the
CPU affinity of every process of the arm (sampled every few seconds: the pinning is real).
Writes `bench_learn.json` into `--out` and prints a summary table. `--pipeline-flags` gives
every pipeline more flags (e.g. `'--max-staleness 0'`: synchronous pipelines, whose engine and
trainer each idle while the other works: the capacity time-sharing is for).

    nice -n 10 .venv/bin/python scripts/bench_pipelines.py --learn --num-steps 40 \
        --arms solo,split,shared,scheduled

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
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

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


class LearnRun(NamedTuple):
    """What every pipeline of `--learn` is given: its eval interval and `--pipeline-flags`."""

    every: int
    flags: tuple[str, ...] = ()


def _learn_argv(run_dir: Path, steps: int, seed: int, run: LearnRun) -> list[str]:
    """The embedded default as it learns (warm start and eval at their defaults but the
    interval), `steps` steps, one seed per pipeline, then the bench's `--pipeline-flags`."""
    return ["--run-dir", str(run_dir), "--num-steps", str(steps), "--seed", str(seed),
            "--eval-interval", str(run.every), *run.flags]  # fmt: skip


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


async def _learn_solo(out: Path, steps: int, run: LearnRun) -> dict:
    t0, per = time.perf_counter(), {}
    for name, seed in LEARN_SEEDS.items():
        d = out / "solo" / name
        wall = await _timed(train(parse_config(_learn_argv(d, steps, seed, run))))
        per[name] = {**_curve(d), "wall_s": wall}
    return {"wall_s": time.perf_counter() - t0, "pipelines": per}


async def _learn_shared(out: Path, steps: int, run: LearnRun) -> dict:
    import ray

    cfg = PipelineSchedulerConfig(slots=1, min_hold_s=1.0, min_pipelines=2)
    sched = start_scheduler("bench-learn", cfg)
    t0 = time.perf_counter()
    dirs = {n: out / "shared" / n for n in LEARN_SEEDS}
    extra = ["--pipeline-scheduler", "bench-learn", "--pipeline-name"]
    walls = await asyncio.gather(
        *(
            _timed(train(parse_config([*_learn_argv(d, steps, LEARN_SEEDS[n], run), *extra, n])))
            for n, d in dirs.items()
        )
    )
    wall = time.perf_counter() - t0
    state = await sched.state.remote()
    ray.kill(sched)
    per = {n: {**_curve(d), "wall_s": w} for (n, d), w in zip(dirs.items(), walls)}
    return {"wall_s": wall, "pipelines": per, **handovers(state["events"]),
            "slot_s": state["served_s"], "events": state["events"]}  # fmt: skip


async def _timed(coro) -> float:
    t0 = time.perf_counter()
    await coro
    return time.perf_counter() - t0


def handovers(events: list) -> dict:
    """From the scheduler's events: slots granted to another pipeline than the slot's last
    holder (`handovers`: what a switch between pipelines costs), and slots a pipeline released
    and was granted back with nobody between (`own_returns`: its own trainer step's sleep)."""
    last: dict[int, str] = {}
    moved = own = 0
    for _, name, what in events:
        if what.startswith("granted slot "):
            slot = int(what.split()[2])
            if slot in last:
                moved, own = moved + (last[slot] != name), own + (last[slot] == name)
            last[slot] = name
    return {"handovers": moved, "own_returns": own}


async def _affinities(seen: dict, every_s: float = 5.0) -> None:
    """Every `every_s`: each process under this one, its name and CPU affinity (until cancelled)."""
    import psutil

    me = psutil.Process()
    while True:
        for proc in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                seen[proc.pid] = (
                    proc.name(),
                    sorted(proc.cpu_affinity()),
                    sum(proc.cpu_times()[:2]),
                )
        await asyncio.sleep(every_s)


def _pinning(seen: dict) -> dict:
    """CPU seconds by affinity (e.g. "0", "1", "0,1") over the processes seen."""
    out: dict[str, dict] = {}
    for name, cores, cpu_s in seen.values():
        row = out.setdefault(",".join(map(str, cores)), {"processes": 0, "cpu_s": 0.0, "names": []})
        row["processes"] += 1
        row["cpu_s"] += cpu_s
        if name not in row["names"]:
            row["names"].append(name)
    return out


async def _learn_scheduled(out: Path, steps: int, run: LearnRun) -> dict:
    """Two slots, one per core; each pipeline's trainer on its own core, that slot its trainer
    slot; its engines on both (engine i on slot i, pinned to core i)."""
    import ray

    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise RuntimeError("the scheduled arm needs 2 usable cores (one slot per core)")
    own = {n: i for i, n in enumerate(LEARN_SEEDS)}  # a trains on slot/core 0, b on 1
    cfg = PipelineSchedulerConfig(
        slots=2, min_hold_s=1.0, min_pipelines=2, sleep_level=1, overlap_others=True,
        trainer_slots={n: (i,) for n, i in own.items()},
    )  # fmt: skip
    sched = start_scheduler("bench-two", cfg)
    dirs = {n: out / "scheduled" / n for n in LEARN_SEEDS}
    extra = {
        n: ["--pipeline-scheduler", "bench-two", "--pipeline-name", n, "--num-engines", "2",
            "--trainer-cores", str(cores[own[n]]), "--rollout-cores", f"{cores[0]},{cores[1]}"]
        for n in LEARN_SEEDS
    }  # fmt: skip
    seen: dict = {}
    watch = asyncio.create_task(_affinities(seen))
    t0 = time.perf_counter()
    walls = await asyncio.gather(
        *(
            _timed(train(parse_config([*_learn_argv(d, steps, LEARN_SEEDS[n], run), *extra[n]])))
            for n, d in dirs.items()
        )
    )
    wall = time.perf_counter() - t0
    watch.cancel()
    state = await sched.state.remote()
    ray.kill(sched)
    per = {n: {**_curve(d), "wall_s": w} for (n, d), w in zip(dirs.items(), walls)}
    return {"wall_s": wall, "pipelines": per, **handovers(state["events"]),
            "slot_s": state["served_s"], "events": state["events"],
            "pinning": _pinning(seen)}  # fmt: skip


def _learn_split(out: Path, steps: int, run: LearnRun) -> dict:
    """a on core 0, b on core 1: two processes (each its own Ray node), side by side."""
    root = Path(__file__).resolve().parents[1]
    t0, procs = time.perf_counter(), {}
    for core, (name, seed) in enumerate(LEARN_SEEDS.items()):
        d = out / "split" / name
        d.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["taskset", "-c", str(core), sys.executable, str(root / "train_async.py")]
        log = open(out / "split" / f"{name}.log", "w")  # noqa: SIM115 (closed below)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        argv = [*cmd, *_learn_argv(d, steps, seed, run)]
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
        procs[name] = (proc, log)
    walls: dict[str, float] = {}
    while len(walls) < len(procs):  # each one's own end
        for name, (proc, log) in procs.items():
            if name in walls or proc.poll() is None:
                continue
            walls[name] = time.perf_counter() - t0
            log.close()
            if proc.returncode != 0:
                raise RuntimeError(
                    f"split arm: pipeline {name} exited {proc.returncode}: {log.name}"
                )
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    per = {n: {**_curve(out / "split" / n), "wall_s": walls[n]} for n in procs}
    return {"wall_s": wall, "pipelines": per}


LEARN_ARMS = {"solo": _learn_solo, "shared": _learn_shared, "scheduled": _learn_scheduled}
"""The in-process arms (one Ray node in this process); `split` runs two processes."""


def _samples_per_group(run_dir: Path) -> int:
    """`n_samples_per_prompt` as the run recorded it (its config.json)."""
    cfg = json.loads((run_dir / "config.json").read_text())
    stack = [cfg]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("n_samples_per_prompt"), int):
                return node["n_samples_per_prompt"]
            stack.extend(node.values())
    raise RuntimeError(f"{run_dir}/config.json: no n_samples_per_prompt")


def _rates(out: Path, arm: str, res: dict) -> None:
    """Trained samples and samples/s, per pipeline (over its own wall time) and aggregate."""
    total = 0
    for name, p in res["pipelines"].items():
        p["trained_samples"] = p["trained_groups"] * _samples_per_group(out / arm / name)
        p["samples_per_s"] = p["trained_samples"] / p["wall_s"]
        total += p["trained_samples"]
    res["trained_samples"], res["samples_per_s"] = total, total / res["wall_s"]


def summary(res: dict) -> str:
    """One row per arm: wall, aggregate samples/s and its ratio to solo's, each pipeline's
    samples/s (and ratio to its solo), hand-overs."""
    solo = res.get("solo")
    rows = ["| arm | wall s | samples/s | vs solo | per pipeline samples/s (vs its solo) | hand-overs "
            "| granted slot-seconds |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, r in res.items():
        if arm not in (*LEARN_ARMS, "split"):  # e.g. a saved file's "pipeline_flags"
            continue
        ratio = f"{r['samples_per_s'] / solo['samples_per_s']:.2f}x" if solo else "-"
        per = []
        for n, p in r["pipelines"].items():
            mine = f"{n} {p['samples_per_s']:.1f}"
            if solo and n in solo["pipelines"]:
                mine += f" ({p['samples_per_s'] / solo['pipelines'][n]['samples_per_s']:.2f}x)"
            per.append(mine)
        hand = r.get("handovers", "-")
        if "own_returns" in r:
            hand = f"{hand} (+{r['own_returns']} own trainer-step sleeps)"
        grants = ", ".join(f"{n} {v:.0f}" for n, v in r.get("slot_s", {}).items()) or "-"
        rows.append(f"| {arm} | {r['wall_s']:.0f} | {r['samples_per_s']:.1f} | {ratio} | "
                    f"{', '.join(per)} | {hand} | {grants} |")  # fmt: skip
    return "\n".join(rows)


def learn(out: Path, steps: int, run: LearnRun, arms: list[str]) -> dict:
    if bad := sorted(set(arms) - {*LEARN_ARMS, "split"}):
        raise SystemExit(f"--arms: unknown {bad}; pick from solo, shared, split, scheduled")
    res: dict = {}
    for arm in arms:
        t = time.perf_counter()
        if arm == "split":
            res[arm] = _learn_split(out, steps, run)
        else:
            init_ray(num_cpus=8)
            res[arm] = asyncio.run(LEARN_ARMS[arm](out, steps, run))
        _rates(out, arm, res[arm])
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
    ap.add_argument("--learn", action="store_true", help="learning curves: see --arms")
    ap.add_argument("--eval-interval", type=int, default=10, help="steps between evals (--learn)")
    ap.add_argument(
        "--arms", default="solo,shared,split,scheduled", help="arms of --learn, in this order"
    )
    ap.add_argument(
        "--pipeline-flags", default="", help="more train_async.py flags for every pipeline of "
        "--learn (e.g. '--max-staleness 0': synchronous pipelines, idle half of each step)"
    )  # fmt: skip
    args = ap.parse_args()
    if args.learn:
        out = Path(args.out)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        run = LearnRun(args.eval_interval, tuple(shlex.split(args.pipeline_flags)))
        res = learn(out, args.num_steps, run, args.arms.split(","))
        saved = {**res, "pipeline_flags": list(run.flags)}  # the arms, and what they were given
        (out / "bench_learn.json").write_text(json.dumps(saved, indent=2))
        print(json.dumps(saved, indent=2))
        print(summary(res))
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
