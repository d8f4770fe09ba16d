"""Benchmark: the trainer on SmolLM2-135M shapes at the hardware's limit (the `speed` part of
`scripts/bench_trainer.py`).

For each configuration — fp32 / bf16 compute, chunked log-prob head / the full `[tokens,
vocab]` logits (`--logits-chunk-tokens 0`), and bf16 chunked with full activation recompute
(`rc`: `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`;
MFU then still counts 6·N·tokens, not the recompute's extra forward) — a fresh process builds a `MegatronTrainer` with
SmolLM2-135M's shapes (random weights: speed does not depend on them), trains `--speed-steps`
steps (after one warm-up) on a batch shaped like the SmolLM2 recipe's (32 samples of 60-100
tokens, packed into 4096-token micro-batches), and reports the median step time, tokens/s,
the training forward+backward's time, peak RSS (and peak GPU memory on CUDA). Beside them, the
machine's own ceiling, measured in the same run: one matmul's FLOP/s in fp32 and bf16 on the
same threads (or the GPU), and the model FLOP utilisation of the forward+backward:

    MFU = 6 · N · tokens / fwd_bwd_seconds / peak_matmul_FLOP/s     (N = parameters)

    .venv/bin/python scripts/bench_trainer.py --only speed
    .venv/bin/python scripts/bench_trainer_speed.py --threads 1 --speed-steps 2

`--limit` (`bench_limit`) puts the step against its own matmuls instead of one square matmul:
each worker process times the GEMMs one training forward+backward runs (`gemm_shapes`: every
linear layer's forward, input and weight gradient at the batch's token count, the chunked
head's four products per chunk; in the compute dtype, the operands laid out as the step has
them) before and after its steps, and reports 6·N·tokens / forward+backward seconds / that
rate, in wall-clock seconds and in the process's CPU seconds (on a loaded machine the wall
clock also counts waiting for a core; CPU seconds do not). This tree's worker alternates the
eager and the fused CPU kernels (`--cpu-fused-kernels`, slime_async/trainer/fused.py) step by step;
`--limit-base main` also runs the tree of that commit (its defaults: eager), back to back:

    nice -n 10 .venv/bin/python scripts/bench_trainer_speed.py --limit --limit-base main
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slime_async.config.memory_plan import param_count  # noqa: E402
from slime_async.contracts.model import SMOLLM2_135M  # noqa: E402

SMOLLM2 = SMOLLM2_135M
CONFIGS = {  # name: (bf16, logits chunk tokens (None: the chunked default, 0: full), recompute)
    "fp32 full logits": (False, 0, False),
    "fp32 chunked": (False, None, False),
    "bf16 full logits": (True, 0, False),
    "bf16 chunked": (True, None, False),
    "bf16 chunked rc": (True, None, True),
}

WORKER = r"""
import json, resource, statistics, sys, time
import torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
from slime_async.contracts.model import ModelSpec
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.testing import random_batch
from slime_async.trainer.trainer import MegatronTrainer
spec = ModelSpec.from_dict(args["spec"])
rc = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
cfg = TrainerConfig(lr=1e-6, seed=0, bf16=args["bf16"], logits_chunk_tokens=args["chunk"],
                    use_dynamic_batch_size=True, max_tokens_per_gpu=4096,
                    **(rc if args["recompute"] else {}))
tr = MegatronTrainer(cfg, spec)
lengths = args["lengths"]
b = random_batch(spec, batch=len(lengths), width=max(lengths), prompt=40, seed=1, lengths=lengths)
cpu = []
inner = tr._forward_backward
def timed(*a, **kw):  # CPU seconds of the training forward+backward (this process, all threads)
    c = time.process_time()
    out = inner(*a, **kw)
    cpu.append(time.process_time() - c)
    return out
tr._forward_backward = timed
modes = args.get("modes") or [None]
if modes != [None]:
    from slime_async.trainer import fused
limit = args.get("limit")
if limit:
    sys.path.insert(0, args["scripts"])
    from bench_trainer_speed import gemm_rate
    dtype = torch.bfloat16 if args["bf16"] else torch.float32
    rates = [gemm_rate(limit, dtype)]
steps, fb, fb_cpu = {}, {}, {}
for i in range(args["steps"] + 1):
    for mode in modes:
        if mode is not None:
            fused.install(mode == "fused")
        t = time.perf_counter()
        m = tr.train_step(b)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i:
            steps.setdefault(str(mode), []).append(time.perf_counter() - t)
            fb.setdefault(str(mode), []).append(m["timing/train_fwd_bwd_s"])
            fb_cpu.setdefault(str(mode), []).append(cpu[-1])
if limit:
    rates.append(gemm_rate(limit, dtype))
med = lambda d: {k: statistics.median(v) for k, v in d.items()}
out = {"step_s": med(steps), "fwd_bwd_s": med(fb), "fwd_bwd_cpu_s": med(fb_cpu),
       "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
       "gpu_gib": torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else 0}
if limit:
    out["gemm"] = {k: max(r[k] for r in rates) for k in rates[0]}
if modes == [None]:
    out = {k: (v["None"] if isinstance(v, dict) and "None" in v else v) for k, v in out.items()}
print("RESULT " + json.dumps(out))
"""


def recipe_lengths(n: int = 32) -> list[int]:
    """Prompt + response tokens of a SmolLM2 recipe batch (chat-templated chain_sum prompts of
    ~60 tokens and replies of up to 32): 60-100 tokens, deterministic."""
    return [60 + (i * 13) % 41 for i in range(n)]


def matmul_peak(dtype: torch.dtype, *, device: str, n: int) -> float:
    """Best FLOP/s of an `n`×`n`×`n` matmul in `dtype` on `device` (10 tries after a warm-up)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(11):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        (a @ b).sum().item() if device == "cuda" else a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def gemm_shapes(
    spec: object, tokens: int, read: int, tile: tuple[int, int]
) -> list[tuple[int, int, int, str, int]]:
    """The matmuls of one training forward+backward of a dense `spec` on `tokens` packed tokens
    with `read` of them through the head in tiles of `tile` = (chunk tokens, vocabulary rows;
    `lm_head.tiling`): `(m, k, n, form, count)`, `form` the operands' layout as the step has it
    ('nt': x @ wᵀ, 'nn': g @ w, 'tn': gᵀ @ x). Per linear layer the forward, the input gradient
    and the weight gradient; the head per tile its forward, the backward's recomputed forward,
    and its two gradients (the weight's as hᵀ @ ∂z, 'nn'). Attention's own batched products
    (q·kᵀ, p·v; under 5% of the FLOPs at these lengths) are left out."""
    h, q = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    kv, f, L = spec.num_key_value_heads * spec.head_dim, spec.intermediate_size, spec.num_layers
    out = []
    for o, i in ((q + 2 * kv, h), (h, q), (2 * f, h), (h, f)):
        out += [(tokens, i, o, "nt", L), (tokens, o, i, "nn", L), (o, tokens, i, "tn", L)]
    v, (chunk, block) = spec.vocab_size, tile
    for c, cn in ((chunk, read // chunk), (read % chunk, 1)):
        for b, bn in ((block, v // block), (v % block, 1)):
            n = cn * bn
            if c and b and n:
                out += [(c, h, b, "nt", 2 * n), (c, b, h, "nn", n), (h, c, b, "nn", n)]
    return out


def gemm_rate(shapes: list, dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s of the matmuls `shapes` (`gemm_shapes`) in `dtype` on this process's threads:
    each shape's best of 3 (after a warm-up) times its count; `wall` in wall-clock seconds,
    `cpu` in this process's CPU seconds (what a loaded machine's wall clock adds is waiting)."""
    flops = wall = cpu = 0.0
    for m, k, n, form, count in shapes:
        a = torch.randn(m, k).to(dtype) if form != "tn" else torch.randn(k, m).to(dtype).t()
        b = torch.randn(n, k).to(dtype).t() if form == "nt" else torch.randn(k, n).to(dtype)
        best_w = best_c = float("inf")
        for i in range(4):
            t, c = time.perf_counter(), time.process_time()
            a @ b
            if i:
                best_w = min(best_w, time.perf_counter() - t)
                best_c = min(best_c, time.process_time() - c)
        flops += 2 * m * k * n * count
        wall += best_w * count
        cpu += best_c * count
    return {"wall": flops / wall, "cpu": flops / cpu, "flops": flops}


def run_config(
    name: str, *, threads: int, steps: int, lengths: list[int], tree: Path = ROOT, **extra: object
) -> dict:
    bf16, chunk, recompute = CONFIGS[name]
    args = dict(
        spec=SMOLLM2.to_dict(), bf16=bf16, chunk=chunk, recompute=recompute, threads=threads,
        steps=steps, lengths=lengths, scripts=str(ROOT / "scripts"), **extra,
    )  # fmt: skip
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    return run_worker(WORKER, args, cwd=tree, env={**os.environ, "PYTHONPATH": path}, what=name)


def run_worker(code: str, args: dict, *, cwd: Path, env: dict[str, str], what: str) -> object:
    """Run `code` in a fresh Python process with `args` (JSON, its argv[1]) and return what it
    printed on its last `RESULT <json>` line; raises with its stderr's tail when it failed.
    The process mallocs on huge pages as a run's actors do (`host.huge_page_malloc`), unless
    `env` sets `GLIBC_TUNABLES` (empty: glibc's defaults)."""
    from slime_async.host import huge_page_malloc  # here: a worker of a base tree imports this file

    env = dict(env)
    huge_page_malloc(env)
    p = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not line:
        raise RuntimeError(f"{what} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[-1][len("RESULT ") :])


def bench_speed(args: argparse.Namespace) -> dict:
    """Measure every configuration and the matmul peaks; print one table; return the numbers."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    threads = args.threads
    torch.set_num_threads(threads)
    n = 8192 if cuda else 2048

    def measure_peak() -> dict[str, float]:
        return {
            "fp32": matmul_peak(torch.float32, device=device, n=n),
            "bf16": matmul_peak(torch.bfloat16, device=device, n=n),
        }

    peak = measure_peak()
    lengths = recipe_lengths()
    tokens = sum(lengths)
    params = param_count(SMOLLM2)
    where = torch.cuda.get_device_name() if cuda else f"{threads} CPU thread(s)"
    print(
        f"\n[speed] SmolLM2-135M shapes ({params / 1e6:.1f}M parameters), {len(lengths)} samples "
        f"/ {tokens} tokens per step, on {where}; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"matmul peak ({n}^3): fp32 {peak['fp32'] / 1e9:.1f} GFLOP/s, "
        f"bf16 {peak['bf16'] / 1e9:.1f} GFLOP/s (bf16/fp32 {peak['bf16'] / peak['fp32']:.2f}x)"
    )
    rows: dict[str, dict] = {}
    for name in args.configs:
        rows[name] = run_config(name, threads=threads, steps=args.speed_steps, lengths=lengths)
    # the peak again after the runs (a shared machine's load moves it): the better of the two
    again = measure_peak()
    peak = {k: max(v, again[k]) for k, v in peak.items()}
    print(
        f"matmul peak, the better of before/after: fp32 {peak['fp32'] / 1e9:.1f}, "
        f"bf16 {peak['bf16'] / 1e9:.1f} GFLOP/s"
    )
    hdr = f"{'configuration':<18} {'step s':>8} {'tok/s':>8} {'fwd+bwd s':>10} {'MFU':>6} "
    print(hdr + f"{'peak RSS GiB':>13}" + (f" {'GPU GiB':>8}" if cuda else ""))
    for name, r in rows.items():
        dtype = "bf16" if CONFIGS[name][0] else "fp32"
        r["tokens_per_s"] = tokens / r["step_s"]
        r["mfu"] = 6 * params * tokens / r["fwd_bwd_s"] / peak[dtype]
        print(
            f"{name:<18} {r['step_s']:>8.2f} {r['tokens_per_s']:>8.0f} {r['fwd_bwd_s']:>10.2f} "
            f"{r['mfu']:>6.1%} {r['rss_gib']:>13.2f}" + (f" {r['gpu_gib']:>8.2f}" if cuda else "")
        )
    if "fp32 chunked" in rows and "bf16 chunked" in rows:
        a, b = rows["fp32 chunked"], rows["bf16 chunked"]
        print(f"bf16/fp32 (chunked): step time {b['step_s'] / a['step_s']:.2f}x")
    for dt in ("fp32", "bf16"):
        full, ch = rows.get(f"{dt} full logits"), rows.get(f"{dt} chunked")
        if full and ch:
            print(
                f"{dt} chunked/full: step time {ch['step_s'] / full['step_s']:.2f}x, "
                f"peak RSS {ch['rss_gib'] / full['rss_gib']:.2f}x"
                + (f", GPU memory {ch['gpu_gib'] / full['gpu_gib']:.2f}x" if cuda else "")
            )
    result = {"device": where, "params": params, "tokens": tokens, "peak": peak, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def bench_limit(args: argparse.Namespace) -> dict:
    """The train step against the matmul limit at the recipe's shapes, this tree (the eager and
    the fused CPU kernels, alternating step by step in one process) and, with
    `--limit-base`, the tree of that commit (a fresh process, back to back): each process measures
    the rate of the step's own matmuls (`gemm_shapes`) before and after its steps (the better
    of the two) and reports 6·N·tokens / forward+backward seconds / that rate, in wall-clock
    and in CPU seconds."""
    from slime_async.trainer.lm_head import tiling

    lengths = recipe_lengths()
    tokens, params = sum(lengths), param_count(SMOLLM2)
    read = tokens - 40 * len(lengths)  # the worker's batch: 40 prompt tokens a sample
    shapes = gemm_shapes(SMOLLM2, tokens, read, tiling(read, SMOLLM2.vocab_size))
    name = args.limit_config
    load = [os.getloadavg()]
    print(
        f"\n[limit] {name}, SmolLM2-135M shapes ({params / 1e6:.1f}M parameters), "
        f"{len(lengths)} samples / {tokens} tokens ({read} through the head), "
        f"{args.threads} thread(s), {args.speed_steps} timed step(s) per mode; "
        f"load average {load[0][0]:.1f}"
    )
    runs: list[tuple[str, Path, list[str] | None]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.limit_base:
            runs.append((f"base {args.limit_base}", _base_tree(args.limit_base, tmp), None))
        runs.append(("this tree", ROOT, ["eager", "fused"]))
        rows = {}
        for _ in range(args.limit_rounds):
            for label, tree, modes in runs:
                r = run_config(
                    name, threads=args.threads, steps=args.speed_steps, lengths=lengths,
                    tree=tree, limit=shapes, modes=modes,
                )  # fmt: skip
                for mode in modes or [None]:
                    key = label if mode is None else f"{label}, {mode} kernels"
                    pick = (lambda v: v) if mode is None else (lambda v, m=mode: v[m])
                    row = {k: pick(r[k]) for k in ("step_s", "fwd_bwd_s", "fwd_bwd_cpu_s")}
                    rows.setdefault(key, []).append(
                        {**row, "gemm": r["gemm"], "rss_gib": r["rss_gib"]}
                    )
    load.append(os.getloadavg())
    flops = 6 * params * tokens
    print(
        f"{'tree / kernels':<36} {'fwd+bwd s':>9} {'CPU s':>7} {'GEMM GFLOP/s':>13} "
        f"{'6NT/limit':>9} {'(CPU)':>6} {'GEMM share':>10} {'peak RSS GiB':>12}"
    )
    out = {}
    for key, rs in rows.items():
        for r in rs:
            g = r["gemm"]
            r["frac_wall"] = flops / r["fwd_bwd_s"] / g["wall"]
            r["frac_cpu"] = flops / r["fwd_bwd_cpu_s"] / g["cpu"]
            r["gemm_share"] = g["flops"] / g["cpu"] / r["fwd_bwd_cpu_s"]
            print(
                f"{key:<36} {r['fwd_bwd_s']:>9.2f} {r['fwd_bwd_cpu_s']:>7.2f} "
                f"{g['wall'] / 1e9:>6.0f}/{g['cpu'] / 1e9:<6.0f} {r['frac_wall']:>9.1%} "
                f"{r['frac_cpu']:>6.1%} {r['gemm_share']:>10.1%} {r['rss_gib']:>12.2f}"
            )
        out[key] = rs
    print(
        f"GEMM GFLOP/s: the step's matmuls alone, wall/CPU; 6NT/limit = 6·N·tokens / fwd+bwd s / "
        f"GEMM rate (wall, then CPU seconds); GEMM share = the step's matmul FLOPs "
        f"({shapes and sum(2 * m * k * n * c for m, k, n, _, c in shapes) / 1e12:.2f} TFLOP) at the "
        f"GEMM rate / fwd+bwd CPU s; peak RSS of the process (both kernel modes ran in one). "
        f"Load average before {load[0][0]:.1f}, after {load[1][0]:.1f}"
    )
    result = {"tokens": tokens, "read": read, "params": params, "rows": out, "load": load}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def _base_tree(commit: str, into: str) -> Path:
    tree = Path(into) / "base"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=1, help="torch threads (speed part)")
    ap.add_argument("--speed-steps", type=int, default=2, help="timed steps per configuration")
    ap.add_argument(
        "--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="which ones"
    )
    ap.add_argument("--json", help="also write the numbers to this file")
    ap.add_argument(
        "--limit", action="store_true", help="the step against its matmuls' rate (bench_limit)"
    )
    ap.add_argument("--limit-config", default="bf16 chunked", choices=list(CONFIGS))
    ap.add_argument("--limit-base", help="with --limit: also this commit's tree (e.g. main)")
    ap.add_argument("--limit-rounds", type=int, default=1, help="with --limit: rounds over trees")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_args(ap)
    a = ap.parse_args()
    bench_limit(a) if a.limit else bench_speed(a)
