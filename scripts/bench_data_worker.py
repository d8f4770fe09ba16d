"""Scheduling overhead of the RolloutDataWorker per sample (dispatch + completion).

Two measurements, both with ~100k samples queued for dispatch (goal: <= 20 us per sample):

* `core`: the synchronous `SchedulerCore` alone (priority queue, probe/length cache, window,
  budget, accounting): next_dispatch() + on_result() + amortised admission and consumption.
* `worker`: the full asyncio `RolloutDataWorker` with a `generate` that returns at once, so the
  time is the worker's own (task creation, result handling, events, get_batch) on the stock
  asyncio loop.

Usage: .venv/bin/python scripts/bench_data_worker.py [--queued 100000] [--samples 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import time

from data_worker import (
    DataWorkerConfig,
    GenerationResult,
    Prompt,
    RolloutDataWorker,
    SchedulerCore,
    VersionRuns,
)


class EndlessSource:
    """Unbounded prompt stream over `num_keys` distinct keys (cursor = count)."""

    def __init__(self, num_keys: int) -> None:
        self.num_keys = num_keys
        self.count = 0
        self._prompts = [Prompt(key=str(i), prompt_ids=(i,)) for i in range(num_keys)]

    def next_prompt(self) -> Prompt:
        p = self._prompts[self.count % self.num_keys]
        self.count += 1
        return p

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = int(state["count"])


def _config(queued: int, n: int, B: int) -> DataWorkerConfig:
    return DataWorkerConfig(
        n_samples_per_prompt=n,
        groups_per_step=B,
        max_staleness=10**9,
        fifo_window=4 * B,
        max_inflight=1024,
        max_queued_samples=queued,
    )


def _results(num_keys: int) -> list[GenerationResult]:
    out = []
    for i in range(num_keys):
        length = 5000 + (i * 7919) % 25000
        out.append(
            GenerationResult(
                output_ids=range(length),
                token_versions=VersionRuns.constant(0, length),
                payload={},
            )
        )
    return out


def bench_core(queued: int, samples: int, n: int, B: int, num_keys: int) -> float:
    cfg = _config(queued, n, B)
    core = SchedulerCore(cfg, EndlessSource(num_keys), clock=time.perf_counter)
    for i in range(num_keys):  # known prompts: all n samples queue at admission
        core.cache.update(str(i), 5000 + (i * 7919) % 25000)
    results = _results(num_keys)
    while core.admit_one():
        pass
    assert core.queued >= queued - n, core.queued
    inflight = []
    gc.collect()
    gc.disable()
    t0, c0 = time.perf_counter(), time.process_time()
    done = 0
    while done < samples:
        # keep ~max_inflight running: dispatch a wave, then complete it
        while len(inflight) < cfg.max_inflight:
            d = core.next_dispatch()
            inflight.append(d)
        for d in inflight:
            core.on_result(d, results[int(d.request.prompt.key)])
        done += len(inflight)
        inflight.clear()
        while core.take(B, 0) is not None:
            pass
        while core.admit_one():
            pass
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    gc.enable()
    assert core.queued >= queued - cfg.max_inflight - n and core.accounting().balanced
    return dt / done * 1e6, dc / done * 1e6


async def _bench_worker(queued: int, samples: int, n: int, B: int, num_keys: int) -> float:
    cfg = _config(queued, n, B)
    results = _results(num_keys)

    async def generate(request, priority: float, expected_len: int) -> GenerationResult:
        return results[int(request.prompt.key)]

    # known prompts (all n samples queue at admission): restore a state with a warm length cache
    state = RolloutDataWorker(cfg, EndlessSource(num_keys), generate).state_dict()
    state["length_cache"] = {str(i): 5000.0 + (i * 7919) % 25000 for i in range(num_keys)}
    worker = RolloutDataWorker(cfg, EndlessSource(num_keys), generate)
    worker.load_state_dict(state)
    await worker.start()
    queue_before = worker.metrics()["data/queue_depth"]
    assert queue_before >= queued - cfg.max_inflight - n, queue_before
    steps = math.ceil(samples / (n * B))
    gc.collect()
    gc.disable()
    t0, c0 = time.perf_counter(), time.process_time()
    start_calls = worker.metrics()["data/generate_calls"]
    for _ in range(steps):
        await worker.get_batch(B, 0)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    gc.enable()
    m = worker.metrics()
    done = m["data/generate_calls"] - start_calls
    queue_after = m["data/queue_depth"]
    await worker.stop()
    assert queue_after >= queued - cfg.max_inflight - n, queue_after
    return dt / done * 1e6, dc / done * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queued", type=int, default=100_000, help="samples kept queued")
    p.add_argument("--samples", type=int, default=200_000, help="dispatch+completions timed")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--groups-per-step", type=int, default=64, help="B")
    p.add_argument("--keys", type=int, default=4096, help="distinct prompt keys")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    a = p.parse_args()
    args = (a.queued, a.samples, a.n, a.groups_per_step, a.keys)
    core = [bench_core(*args) for _ in range(a.repeats)]
    worker = [asyncio.run(_bench_worker(*args)) for _ in range(a.repeats)]
    print(
        f"queued samples ~{a.queued}, n={a.n}, B={a.groups_per_step}, {a.samples} samples "
        f"timed, best of {a.repeats} (wall includes time other processes take on a shared CPU)"
    )
    print("path                          wall us/sample   cpu us/sample   goal <= 20 us (cpu)")
    for name, runs in (("core   (SchedulerCore)", core), ("worker (asyncio, full path)", worker)):
        wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
        print(f"{name:28s}  {wall:14.2f}   {cpu:13.2f}   {'OK' if cpu <= 20 else 'MISSED'}")


if __name__ == "__main__":
    main()
