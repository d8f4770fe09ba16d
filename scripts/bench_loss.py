"""Benchmark: CompIS (both sources corrected) vs plain PPO token-mean, forward + backward, CPU.

Measures, in one run on the same inputs, wall time (median of repeats) and peak extra memory
(each variant in a fresh subprocess; peak RSS above the inputs) for:
  ppo        plain PPO token-mean: `ppo_surrogate` + `aggregate` (the reference, 1.00x)
  compis     CompIS, engine clip(0, 2) + staleness cap(5), diagnostics off
  compis+d   the same with all diagnostics on
and prints ratios against the reference. Goals: <= 1.10x time with diagnostics off, <= 1.30x
with them on. Run: `.venv/bin/python scripts/bench_loss.py [--tokens N] [--repeats R]`.
Single-threaded torch by default (the machine is shared; ratios are less noisy that way).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loss import CompISConfig, LossInputs, aggregate, compis_loss, ppo_surrogate

VARIANTS = ("ppo", "compis", "compis+d")


def make_inputs(n_tokens: int, seq_len: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Realistic-looking packed log-probs for `n_tokens` split into sequences of `seq_len`."""
    g = torch.Generator().manual_seed(seed)
    b, t = n_tokens // seq_len, seq_len
    # built in place, so building them never holds more memory than the inputs themselves
    lp_s = torch.rand(b, t, generator=g).mul_(-3.0)
    lp_m = torch.randn(b, t, generator=g).mul_(0.05).add_(lp_s)
    lp_k = torch.randn(b, t, generator=g).mul_(0.2).add_(lp_m)
    lp_t = torch.randn(b, t, generator=g).mul_(0.05).add_(lp_k)
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    lengths = torch.randint(t // 4, t + 1, (b, 1), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths
    return {"lp_t": lp_t, "lp_k": lp_k, "lp_m": lp_m, "lp_s": lp_s, "adv": adv, "mask": mask}


def step(variant: str, x: dict[str, torch.Tensor]) -> float:
    """One forward + backward; returns seconds."""
    lp = x["lp_t"].clone().requires_grad_(True)
    t0 = time.perf_counter()
    if variant == "ppo":
        # the fastest plain-PPO path of this package: masked advantages, no `where` on the loss
        per_tok, _ = ppo_surrogate(lp, x["lp_k"], x["adv"], 0.2, 0.2, mask=x["mask"])
        loss = aggregate(per_tok, x["mask"], "token-mean", premasked=True)
    else:
        cfg = CompISConfig(
            engine_method="clip",
            engine_low=0.0,
            engine_high=2.0,
            staleness_method="cap",
            staleness_high=5.0,
            diagnostics=variant == "compis+d",
        )
        inputs = LossInputs(
            logprobs=lp,
            proximal_logprobs=x["lp_k"],
            rollout_logprobs=x["lp_s"],
            behavior_logprobs=x["lp_m"],
            advantages=x["adv"],
            loss_mask=x["mask"],
        )
        loss = compis_loss(inputs, cfg).loss
    loss.backward()
    return time.perf_counter() - t0


def _peak_rss_kib() -> int:
    """VmHWM of this process (per address space; unlike ru_maxrss it does not inherit the
    parent's peak across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def worker(variant: str, n_tokens: int, seq_len: int) -> None:
    """Subprocess body: peak RSS growth of one forward + backward above the inputs."""
    torch.set_num_threads(1)
    x = make_inputs(n_tokens, seq_len)
    base = _peak_rss_kib()
    step(variant, x)
    print(json.dumps({"peak_extra_mib": (_peak_rss_kib() - base) / 1024}))


def measure_memory(variant: str, n_tokens: int, seq_len: int) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            variant,
            "--tokens",
            str(n_tokens),
            "--seq-len",
            str(seq_len),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_mib"]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=1 << 20, help="tokens per batch (default 1M)")
    ap.add_argument("--seq-len", type=int, default=1024, help="padded sequence length")
    ap.add_argument(
        "--repeats", type=int, default=15, help="timed repeats per variant (interleaved)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.tokens, args.seq_len)
        return
    torch.set_num_threads(args.threads)
    x = make_inputs(args.tokens, args.seq_len)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:  # warm-up
        step(v, x)
    for _ in range(args.repeats):  # interleaved so machine noise hits every variant alike
        for v in VARIANTS:
            times[v].append(step(v, x))
    mem = {v: measure_memory(v, args.tokens, args.seq_len) for v in VARIANTS}
    valid = int(x["mask"].sum())
    print(
        f"bench_loss: {args.tokens} tokens ({valid} valid) as [{args.tokens // args.seq_len}, "
        f"{args.seq_len}] fp32, forward+backward, torch threads={args.threads}, "
        f"median of {args.repeats} interleaved repeats"
    )
    ref_t = statistics.median(times["ppo"])
    ref_m = mem["ppo"]
    print(f"{'variant':<10} {'time ms':>9} {'x ppo':>7} {'peak MiB':>9} {'x ppo':>7}  goal")
    goals = {"ppo": "", "compis": "<= 1.10x time", "compis+d": "<= 1.30x time"}
    for v in VARIANTS:
        t = statistics.median(times[v])
        print(
            f"{v:<10} {t * 1e3:9.2f} {t / ref_t:7.3f} {mem[v]:9.1f} {mem[v] / ref_m:7.3f}  {goals[v]}"
        )


if __name__ == "__main__":
    main()
