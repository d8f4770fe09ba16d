"""Benchmark: sequence packing, the 1F1B pipeline schedule, and the distributed optimizer.

Measured in one run, one thread per rank (prints ratios; the machine may be noisy):

  (1) train-step tokens/s, packed (THD) vs padded (BSHD), on a length distribution like the
      default workload's (the built-in tasks: prompt + response of ~8-26 tokens, 64 samples)
      and on a long-tailed one (Pareto-like, most 16-64 tokens, a few up to `--tail-max`);
      padded = the previous behaviour (fixed `--micro-batch-size`, padded to the longest),
      packed with the same micro-batches, and packed with token-budget micro-batches;
  (2) PP=2 train-step time on an 8-layer variant of the tiny MoE: megatron's 1F1B schedule
      (this tree) vs the hand-written sequential stage schedule of the base commit (`--base`,
      extracted with `git archive`, run by the same worker script), both on padded
      micro-batches; plus 1F1B packed;
  (3) optimizer-state bytes per rank (Adam moments; + fp32 main params under bf16) at DP=2
      with the distributed optimizer vs without;
  (4) `speed`: SmolLM2-135M shapes, fp32 vs bf16 and chunked vs full logits: tokens/s, peak
      RSS, and MFU against the machine's measured matmul peak (scripts/bench_trainer_speed.py).

    .venv/bin/python scripts/bench_trainer.py                  # all three
    .venv/bin/python scripts/bench_trainer.py --only packing   # packing|pipeline|optimizer|speed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_trainer_speed
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree, not the installed package
BASE_COMMIT = "9a863b4"  # main before issue 14: sequential PP schedule, plain AdamW

# One rank of a multi-rank measurement; runs against whichever tree is the cwd (the old
# trainer API is a subset of the new one: `extra` only carries flags the tree knows).
WORKER = r"""
import json, os, statistics, sys, time
import torch
import torch.multiprocessing as mp

def run(rank, args):
    torch.set_num_threads(1)
    from slime_async.contracts.model import ModelSpec
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer
    spec = ModelSpec.from_dict(args["spec"])
    cfg = TrainerConfig(lr=1e-4, seed=0, **args["cfg"])
    tr = MegatronTrainer(cfg, spec, rank=rank, world_size=args["world"], master_port=args["port"])
    b = random_batch(spec, batch=len(args["lengths"]), width=max(args["lengths"]), prompt=4,
                     seed=1, lengths=args["lengths"])
    times, cpu = [], []
    for i in range(args["steps"] + 1):
        t, c = time.perf_counter(), time.process_time()
        tr.train_step(b)
        if i:
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    state = 0
    opt = getattr(tr, "optim", None)
    if opt is not None:
        state = opt.state_bytes()
    else:  # the base tree: a plain torch AdamW
        for st in tr.optimizer.state.values():
            state += sum(v.numel() * v.element_size() for k, v in st.items() if k != "step")
    out = {"rank": rank, "median_s": statistics.median(times), "min_s": min(times),
           "cpu_s": statistics.median(cpu), "state_bytes": state}
    with open(os.path.join(args["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)

if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    mp.spawn(run, args=(args,), nprocs=args["world"], join=True)
"""


def default_like_lengths(n: int = 64, seed: int = 0) -> list[int]:
    """Prompt + response lengths of the default workload (built-in tasks, expected length)."""
    from slime_async.rollout.data.tasks import TaskFamily

    return [len(p.prompt_ids) + len(p.response_ids) for p in TaskFamily().train_prompts(seed, n)]


def long_tail_lengths(n: int, *, tail_max: int, seed: int = 0) -> list[int]:
    """Most samples 16-64 tokens, a Pareto tail up to `tail_max` (an RL batch's skew)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(16 + rng.pareto(1.1, n) * 24, 16, tail_max)]


def _batch(lengths: list[int]):
    from slime_async.contracts.model import TINY_MOE
    from slime_async.trainer.testing import random_batch

    return random_batch(
        TINY_MOE, batch=len(lengths), width=max(lengths), prompt=4, seed=1, lengths=lengths
    )


def _time_round_robin(trainers: dict[str, object], batch, steps: int) -> dict[str, float]:
    """Median step time per trainer, their steps interleaved (load drifts hit all alike)."""
    for tr in trainers.values():
        tr.train_step(batch)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for _ in range(steps):
        for name, tr in trainers.items():
            t = time.perf_counter()
            tr.train_step(batch)
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_packing(args: argparse.Namespace) -> None:
    from slime_async.contracts.model import TINY_MOE
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    dists = {
        "default-like": default_like_lengths(64),
        "long-tail": long_tail_lengths(args.tail_batch, tail_max=args.tail_max),
    }
    modes = {
        "padded (bshd, fixed micro-batches)": dict(qkv_format="bshd"),
        "packed (thd, same micro-batches)": dict(qkv_format="thd"),
        "packed (thd, token budget)": dict(
            qkv_format="thd", use_dynamic_batch_size=True, max_tokens_per_gpu=args.max_tokens
        ),
    }
    for name, lengths in dists.items():
        batch = _batch(lengths)
        real = int(batch.lengths.sum())
        pad = 1 - real / (len(lengths) * max(lengths))
        print(
            f"[packing] {name}: {len(lengths)} samples, lengths median "
            f"{int(np.median(lengths))} max {max(lengths)}, {real} tokens "
            f"(one padded [B, T] block would be {100 * pad:.0f}% padding)"
        )
        mbs = args.micro_batch_size
        trainers = {
            mode: MegatronTrainer(
                TrainerConfig(lr=1e-4, seed=0, micro_batch_size=mbs, **kw), TINY_MOE
            )
            for mode, kw in modes.items()
        }
        medians = _time_round_robin(trainers, batch, args.steps)
        for tr in trainers.values():
            tr.shutdown()
        rates = {}
        for mode, t in medians.items():
            rates[mode] = real / t
            print(f"  {mode:38s} step {t * 1e3:8.1f} ms  {rates[mode]:9.0f} tokens/s")
        base = rates["padded (bshd, fixed micro-batches)"]
        for mode in list(modes)[1:]:
            print(f"  {mode} vs padded: {rates[mode] / base:.2f}x")


def _run_worker(
    tree: Path, cfg: dict, *, lengths: list[int], world: int, steps: int, layers: int = 2
) -> list[dict]:
    from slime_async.contracts.model import TINY_MOE
    from slime_async.host import free_port

    spec = {**TINY_MOE.to_dict(), "num_layers": layers}
    with tempfile.TemporaryDirectory() as out:
        args = {
            "cfg": cfg,
            "spec": spec,
            "lengths": lengths,
            "world": world,
            "port": free_port(),
            "steps": steps,
            "out": out,
        }
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        script = Path(out) / "worker.py"  # a file: mp.spawn re-imports the main module
        script.write_text(WORKER)
        proc = subprocess.run(
            [sys.executable, str(script), json.dumps(args)],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(f"worker failed in {tree}:\n{proc.stderr[-3000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


def _base_tree(commit: str, into: str) -> Path:
    tree = Path(into) / "base"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def bench_pipeline(args: argparse.Namespace) -> None:
    lengths = long_tail_lengths(16, tail_max=128, seed=3)
    mbs = {"micro_batch_size": 2}
    with tempfile.TemporaryDirectory() as tmp:
        base = _base_tree(args.base, tmp)
        runs = {
            f"sequential stages (base {args.base}, padded)": (
                base,
                {"pipeline_model_parallel_size": 2, **mbs},
            ),
            "megatron 1F1B (padded, bshd)": (
                ROOT,
                {"pipeline_model_parallel_size": 2, "qkv_format": "bshd", **mbs},
            ),
            "megatron 1F1B (packed, thd)": (ROOT, {"pipeline_model_parallel_size": 2, **mbs}),
        }
        res: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):  # alternate the configurations (load drifts)
            for name, (tree, cfg) in runs.items():
                r = _run_worker(
                    tree, cfg, lengths=lengths, world=2, steps=args.steps, layers=args.pp_layers
                )
                res[name].append(max(x["median_s"] for x in r))
                cpu[name].append(sum(x["cpu_s"] for x in r))
        for name, ts in res.items():
            print(
                f"[pipeline] PP=2, {args.pp_layers} layers, 8 micro-batches of 2: {name:42s} step "
                f"{statistics.median(ts) * 1e3:7.1f} ms (per round: "
                + ", ".join(f"{t * 1e3:.0f}" for t in ts)
                + f"); CPU time of both ranks {statistics.median(cpu[name]) * 1e3:.0f} ms"
            )
    res = {k: statistics.median(v) for k, v in res.items()}
    seq, one_f, _ = res.values()
    print(f"[pipeline] 1F1B vs sequential (both padded): {seq / one_f:.2f}x faster")


def bench_optimizer(args: argparse.Namespace) -> None:
    lengths = [24] * 8
    for bf16 in (False, True):
        got = {}
        for dist_opt in (False, True):
            cfg = {"micro_batch_size": 4, "use_distributed_optimizer": dist_opt, "bf16": bf16}
            r = _run_worker(ROOT, cfg, lengths=lengths, world=2, steps=1)
            got[dist_opt] = [x["state_bytes"] for x in r]
        kind = "bf16 params, fp32 main params + moments" if bf16 else "fp32 params, Adam moments"
        print(
            f"[optimizer] DP=2 ({kind}): per rank without distributed optimizer "
            f"{got[False]} B, with {got[True]} B -> {max(got[True]) / max(got[False]):.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--only", choices=["packing", "pipeline", "optimizer", "speed"], help="one part"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    ap.add_argument("--micro-batch-size", type=int, default=16, help="fixed micro-batch size")
    ap.add_argument("--max-tokens", type=int, default=1024, help="token budget (packed)")
    ap.add_argument("--tail-batch", type=int, default=32, help="samples in the long-tail batch")
    ap.add_argument("--tail-max", type=int, default=768, help="longest long-tail sample")
    ap.add_argument("--base", default=BASE_COMMIT, help="commit with the sequential schedule")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (pipeline part)")
    ap.add_argument(
        "--pp-layers",
        type=int,
        default=8,
        help="layers of the pipeline-part model (the last stage also runs the "
        "output layer and the loss, so a 2-layer model is all last stage)",
    )
    bench_trainer_speed.add_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"cpu threads per rank: 1; load average at start: {os.getloadavg()[0]:.1f}")
    parts = {
        "packing": bench_packing,
        "pipeline": bench_pipeline,
        "optimizer": bench_optimizer,
        "speed": bench_trainer_speed.bench_speed,
    }
    for name, fn in parts.items():
        if args.only in (None, name):
            fn(args)


if __name__ == "__main__":
    main()
