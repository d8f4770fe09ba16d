"""Benchmark: checkpoint save/load, --ckpt-format torch vs torch_dist, at 2 ranks (DP=2 with the
distributed optimizer, gloo, one thread per rank), measured in one run.

For each format: seconds of `checkpoint.save` and of `checkpoint.load` (every sha256 checked),
and rank 0's peak RSS during the save (sampled every 2 ms from /proc/self/status) above its RSS
before it. The Adam state is allocated (zeros) before the first save, so both formats write the
full optimizer state. Prints one JSON line per format and the torch / torch_dist ratios.

    .venv/bin/python scripts/bench_checkpoint.py                 # SmolLM2-135M shapes
    .venv/bin/python scripts/bench_checkpoint.py --model tiny    # the tiny MoE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree, not the installed package


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """Peak RSS of this process while the `with` block runs (sampling thread)."""

    def __enter__(self) -> _Peak:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def _worker(rank: int, world: int, port: int, model: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    import dataclasses

    import torch.distributed as dist

    from slime_async.contracts.model import SMOLLM2_135M, TINY_MOE
    from slime_async.trainer import checkpoint
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    spec = SMOLLM2_135M if model == "smollm2" else TINY_MOE
    tr = MegatronTrainer(TrainerConfig(), spec, rank=rank, world_size=world, master_port=port)
    tr.optim.init_state(step=1)
    tr.version = 1
    rows = []
    for fmt in ("torch_dist", "torch"):  # torch_dist first: the torch save's freed heap
        # would otherwise be reused and hide what torch_dist allocates
        tr.cfg = dataclasses.replace(tr.cfg, ckpt_format=fmt, keep_checkpoints=0)
        d = Path(out) / fmt
        dist.barrier()
        with _Peak() as peak:
            t0 = time.perf_counter()
            ckpt = checkpoint.save(tr, d, extra_state={})
            save_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        checkpoint.load(tr, d)
        load_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        rows.append(
            {
                "format": fmt,
                "save_s": round(save_s, 2),
                "load_s": round(load_s, 2),
                "rank0_rss_before_gib": round(peak.base / 2**30, 3),
                "rank0_save_peak_gib": round(peak.peak / 2**30, 3),
                "rank0_save_extra_gib": round((peak.peak - peak.base) / 2**30, 3),
                "checkpoint_gib": round(size / 2**30, 3),
            }
        )
    if rank == 0:
        Path(out, "rows.json").write_text(json.dumps(rows))
    tr.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    args = p.parse_args()
    from slime_async.trainer.parallel import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(2, free_port(), args.model, out), nprocs=2, join=True)
        rows = json.loads(Path(out, "rows.json").read_text())
    for r in rows:
        print(json.dumps({"model": args.model, "ranks": 2, "layout": "DP2+distopt", **r}))
    b, a = rows  # torch_dist, torch
    print(
        f"torch / torch_dist: rank-0 extra RSS during save "
        f"{a['rank0_save_extra_gib'] / max(b['rank0_save_extra_gib'], 1e-9):.1f}x, "
        f"save {a['save_s'] / b['save_s']:.2f}x, load {a['load_s'] / b['load_s']:.2f}x "
        f"(load avg {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
