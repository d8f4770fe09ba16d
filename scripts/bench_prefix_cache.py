"""Benchmark the embedded engine's prefix cache on a GRPO-shaped load, over real HTTP.

G groups of n samples; every sample is its own `/generate` request (as the rollout client sends
them), a group's samples share one prompt of P tokens, and all requests are submitted at once.
The same load runs on an engine with the prefix cache (default) and one with
`--disable-radix-cache`, rounds alternating so background load hits both. Reported per engine:
wall time, output tokens/s, prompt tokens forwarded, and the share of prompt tokens reused
(`meta_info.cached_tokens`); then a weight push (pause in place, update without a flush,
continue) and one more round, to show the cache restarting from empty on the new version
(`cross_version_hits` must stay 0). One run on this machine (a shared one: read ratios).

    .venv/bin/python scripts/bench_prefix_cache.py [--groups 8] [--n 8] [--prompt-len 512]
        [--new-tokens 32] [--rounds 3] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import aiohttp
import torch

from slime_async.engine import EngineConfig, EngineServer
from slime_async.engine.model import load_model


async def _round(url: str, args: argparse.Namespace, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, 4096, (args.prompt_len,), generator=g).tolist() for _ in range(args.groups)
    ]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(p: list[int], j: int) -> dict:
            body = {
                "input_ids": p,
                "sampling_params": {
                    "max_new_tokens": args.new_tokens,
                    "ignore_eos": True,
                    "sampling_seed": j,
                },
                "return_logprob": True,
            }
            async with s.post(url + "/generate", json=body) as r:
                ans = await r.json()
            assert r.status == 200, ans
            return ans["meta_info"]

        t0 = time.perf_counter()
        metas = await asyncio.gather(*(one(p, j) for p in prompts for j in range(args.n)))
        wall = time.perf_counter() - t0
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    out = sum(m["completion_tokens"] for m in metas)
    return {
        "wall": wall,
        "tok_s": out / wall,
        "forwarded": prompt - cached,
        "share": cached / prompt,
    }


async def _server_cache(url: str) -> dict | None:
    async with aiohttp.ClientSession() as s, s.get(url + "/server_info") as r:
        return (await r.json())["internal_states"][0]["prefix_cache"]


async def main_async(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    on = EngineServer(EngineConfig(dtype=args.dtype, weight_version="0"))
    off = EngineServer(EngineConfig(dtype=args.dtype, weight_version="0", disable_radix_cache=True))
    urls = {"prefix cache": on.start(), "no cache": off.start()}
    rows: dict[str, list[dict]] = {k: [] for k in urls}
    try:
        for r in range(args.rounds):
            order = list(urls.items()) if r % 2 == 0 else list(reversed(urls.items()))
            for name, url in order:
                rows[name].append(await _round(url, args, seed=100 + r))
        with tempfile.TemporaryDirectory() as d:
            load_model(EngineConfig(dtype=args.dtype, seed=1)).model.save_pretrained(d)
            url = urls["prefix cache"]
            async with aiohttp.ClientSession() as s:
                await s.post(url + "/pause_generation", json={"mode": "in_place"})
                upd = {"model_path": d, "weight_version": "1", "flush_cache": False}
                async with s.post(url + "/update_weights_from_disk", json=upd) as resp:
                    assert resp.status == 200, await resp.text()
                await s.post(url + "/continue_generation", json={})
            # the same prompts as round 0: all were cached under version 0
            after = await _round(url, args, seed=100)
        info = await _server_cache(url)
    finally:
        on.stop()
        off.stop()
    print(
        f"\n{args.groups} groups x {args.n} samples, prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, tiny MoE {args.dtype}, {args.threads} thread(s), "
        f"{args.rounds} rounds (median; all rounds in brackets)"
    )
    print(
        f"{'engine':14s} {'wall s':>8s} {'out tok/s':>10s} {'prompt fwd':>11s} {'cached':>7s}"
        "  rounds (wall s)"
    )
    for name, rs in rows.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        walls = ", ".join(f"{x['wall']:.2f}" for x in rs)
        print(
            f"{name:14s} {med['wall']:8.2f} {med['tok_s']:10.1f} {med['forwarded']:11.0f} "
            f"{med['share']:7.3f}  [{walls}]"
        )
    speed = statistics.median(x["tok_s"] for x in rows["prefix cache"]) / statistics.median(
        x["tok_s"] for x in rows["no cache"]
    )
    print(f"throughput with / without the prefix cache: {speed:.2f}x")
    print(
        f"after a push (round 0's prompts again, now version 1): wall {after['wall']:.2f} s, "
        f"cached {after['share']:.3f} (only the group's own samples: its first one misses); "
        f"cross_version_hits {info['cross_version_hits'] if info else 'n/a'}"
    )
    print(f"(load avg {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="Samples per group.")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=1)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
