"""Benchmark the embedded engine's prefix cache on a GRPO-shaped load: forwards, then real HTTP.

Part 1 (forwards, no server): the prefill of G groups x n samples as one batch, against the
prefill the scheduler runs with the cache (the G first samples, then the other samples on their
cached prompts), and one decode step of each resulting batch (`--forward-groups` groups).

Part 2: G groups of n samples; every sample is its own `/generate` request (as the rollout client sends
them), a group's samples share one prompt of P tokens, and all requests are submitted at once.
The same load runs on an engine with the prefix cache (default) and one with
`--disable-radix-cache`, rounds alternating so background load hits both. Reported per engine:
wall time, output tokens/s, prompt tokens forwarded, and the share of prompt tokens reused
(`meta_info.cached_tokens`); then a weight push (pause in place, update without a flush,
continue) and one more round, to show the cache restarting from empty on the new version
(`cross_version_hits` must stay 0). One run on this machine (a shared one: read ratios).

    .venv/bin/python scripts/bench_prefix_cache.py [--groups 8] [--n 8] [--prompt-len 512]
        [--new-tokens 32] [--rounds 3] [--dtype bf16] [--hidden-size 128 --num-layers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import aiohttp
import torch

from slime_async.contracts.model import ModelSpec
from slime_async.engine import EngineConfig, EngineServer, batch
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


def forwards(base: EngineConfig, args: argparse.Namespace) -> None:
    lm = load_model(base)
    g = torch.Generator().manual_seed(0)
    groups, n, plen = args.forward_groups, args.n, args.prompt_len
    prompts = [torch.randint(0, 4096, (plen,), generator=g).tolist() for _ in range(groups)]

    def decode_s(kv: batch.KVBatch) -> float:
        t = time.perf_counter()
        batch.decode(lm, kv, [1] * kv.size, capture=False)
        return time.perf_counter() - t

    rows = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        full = batch.prefill(
            lm,
            [p for p in prompts for _ in range(n)],
            prompt_logits_from=[None] * (groups * n),
            capture=False,
        )
        t_full = time.perf_counter() - t
        t = time.perf_counter()
        first = batch.prefill(lm, prompts, prompt_logits_from=[None] * groups, capture=False)
        past = [batch.row_kv(first.kv, i, plen - 1) for i in range(groups)]
        rest = batch.prefill(
            lm,
            [p for p in prompts for _ in range(n - 1)],
            prompt_logits_from=[None] * (groups * (n - 1)),
            capture=False,
            past=[past[i] for i in range(groups) for _ in range(n - 1)],
        )
        cached = batch.merge(first.kv, rest.kv)
        t_cached = time.perf_counter() - t
        rows.append((t_full, t_cached, decode_s(full.kv), decode_s(cached)))
    med = [statistics.median(x[i] for x in rows) for i in range(4)]
    print(
        f"\n## Part 1: forwards, {groups} groups x {n} samples, prompt {plen} tokens, "
        f"median of {args.rounds}"
    )
    print(
        f"prefill without cache {med[0]:.3f} s, with cache {med[1]:.3f} s "
        f"({med[0] / med[1]:.1f}x less); one decode step {med[2]:.3f} s vs {med[3]:.3f} s"
    )


async def _server_cache(url: str) -> dict | None:
    async with aiohttp.ClientSession() as s, s.get(url + "/server_info") as r:
        return (await r.json())["internal_states"][0]["prefix_cache"]


async def main_async(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    h = args.hidden_size
    spec = ModelSpec(
        hidden_size=h,
        num_layers=args.num_layers,
        head_dim=h // 4,
        intermediate_size=2 * h,
        moe_intermediate_size=h,
    ).to_dict()
    base = EngineConfig(dtype=args.dtype, weight_version="0", model_spec=spec)
    forwards(base, args)
    if args.forwards_only:
        return
    on = EngineServer(base)
    off = EngineServer(dataclasses.replace(base, disable_radix_cache=True))
    urls = {"prefix cache": on.start(), "no cache": off.start()}
    rows: dict[str, list[dict]] = {k: [] for k in urls}
    try:
        for r in range(args.rounds):
            order = list(urls.items()) if r % 2 == 0 else list(reversed(urls.items()))
            for name, url in order:
                rows[name].append(await _round(url, args, seed=100 + r))
        with tempfile.TemporaryDirectory() as d:
            load_model(dataclasses.replace(base, seed=1)).model.save_pretrained(d)
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
        f"\n## Part 2: over HTTP, {args.groups} groups x {args.n} samples, prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, Qwen3-MoE hidden {h} x {args.num_layers} layers "
        f"{args.dtype}, {args.threads} thread(s), "
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
    ap.add_argument("--hidden-size", type=int, default=128, help="128: the tiny MoE.")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--forward-groups", type=int, default=2, help="Groups in part 1.")
    ap.add_argument("--forwards-only", action="store_true", help="Only part 1.")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
