"""Benchmark the embedded engine over real HTTP: output tokens/s at concurrency 1, 8 and 64
(tiny Qwen3-MoE), and the speedup of continuous batching over sequential serving.

Sequential serving = the same engine with `max_running_requests=1` (one request at a time, as
a server without batching would serve them), given the same 64 concurrent requests.
All numbers come from one run on this machine (ratios are what to compare; the machine is shared).

    .venv/bin/python scripts/bench_engine.py [--dtype bf16] [--new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp
import torch

from slime_async.engine import EngineConfig, EngineServer


async def _run_load(
    url: str, *, concurrency: int, requests: int, prompt_len: int, new_tokens: int
) -> dict:
    """`requests` generations from `concurrency` closed-loop clients; returns throughput stats."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (prompt_len,), generator=g).tolist() for _ in range(requests)]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []
    tokens = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def client() -> None:
            nonlocal tokens
            while not queue.empty():
                p = queue.get_nowait()
                body = {
                    "input_ids": p,
                    "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True},
                    "return_logprob": True,
                }
                t0 = time.perf_counter()
                async with s.post(url + "/generate", json=body) as r:
                    ans = await r.json()
                assert r.status == 200, ans
                latencies.append(time.perf_counter() - t0)
                tokens += len(ans["output_ids"])

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": requests,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_per_s": round(tokens / wall, 1),
        "p50_latency_s": round(statistics.median(latencies), 3),
    }


def _serve(dtype: str, max_running: int, threads: int) -> EngineServer:
    srv = EngineServer(
        EngineConfig(dtype=dtype, max_running_requests=max_running, num_threads=threads)
    )
    srv.start()
    return srv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each engine")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved batched/sequential rounds")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    kw = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    results: dict[str, object] = {"dtype": args.dtype, **kw}

    # both engines up at once; batched and sequential rounds alternate, so a burst of load from
    # other processes hits both sides of the ratio alike
    cont, seq = _serve(args.dtype, 64, args.threads), _serve(args.dtype, 1, args.threads)
    try:
        asyncio.run(_run_load(cont.url, concurrency=8, requests=8, **kw))  # warm-up
        asyncio.run(_run_load(seq.url, concurrency=2, requests=2, **kw))
        for c, n in ((1, 8), (8, 32)):
            r = asyncio.run(_run_load(cont.url, concurrency=c, requests=n, **kw))
            results[f"c{c}"] = r
            print(f"continuous batching  concurrency={c:>2}: {r}")
        ratios = []
        for i in range(args.rounds):
            rc = asyncio.run(_run_load(cont.url, concurrency=64, requests=64, **kw))
            rs = asyncio.run(_run_load(seq.url, concurrency=64, requests=64, **kw))
            ratios.append(rc["tok_per_s"] / rs["tok_per_s"])
            results[f"round{i}"] = {"c64": rc, "sequential_c64": rs, "speedup": ratios[-1]}
            print(f"round {i}: continuous batching  concurrency=64: {rc}")
            print(f"round {i}: sequential serving   concurrency=64: {rs}")
    finally:
        cont.stop()
        seq.stop()
    speedup = statistics.median(ratios)
    results["speedup_c64_median"] = round(speedup, 2)
    print(
        "continuous batching speedup over sequential at concurrency 64: "
        f"median {speedup:.2f}x over {len(ratios)} rounds ({', '.join(f'{r:.2f}' for r in ratios)})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
