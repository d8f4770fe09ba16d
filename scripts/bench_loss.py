"""Benchmark: CompIS (both sources corrected) vs plain PPO token-mean, forward + backward, CPU.

Measures, in one run on the same 1M-token inputs (padded [1024, 1024] fp32, ~62% valid):
  ppo        plain PPO token-mean on the same fused path CompIS uses, minus the IS weight
             (the strict reference, 1.00x)
  ppo-api    plain PPO token-mean through the public API: `ppo_surrogate` + `aggregate`
  compis     CompIS, engine clip(0, 2) (TIS) + staleness cap(5), diagnostics off
  compis+d   the same with all diagnostics on
Times: variants interleaved in shuffled order for `--repeats` rounds; ratios are medians of
per-round ratios (paired), plus the min time. Peak memory: each variant in a fresh process,
peak RSS growth of one warm step above the inputs. Goals: <= 1.10x time with diagnostics off,
<= 1.30x with them on. Single-threaded torch by default (the machine is shared).
Run: `.venv/bin/python scripts/bench_loss.py [--tokens N] [--repeats R] [--threads T]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loss import AggMode, CompISConfig, LossInputs, aggregate, compis_loss, ppo_surrogate
from loss.aggregate import aggregate_premasked
from loss.ppo import masked_neg_advantages, ppo_from_neg_adv

VARIANTS = ("ppo", "ppo-api", "compis", "compis+d")


def make_inputs(n_tokens: int, seq_len: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Log-probs of `n_tokens` as padded `[n_tokens // seq_len, seq_len]` with random lengths:
    engine/trainer mismatch σ = 0.05, staleness σ = 0.2, drift σ = 0.05 (nats)."""
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


def _ppo_fused(lp: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """Plain PPO token-mean on the same fused path CompIS uses, minus the IS weight."""
    neg_adv, mask_f = masked_neg_advantages(x["adv"], x["mask"], dtype=torch.float32)
    terms = ppo_from_neg_adv(lp, x["lp_k"], neg_adv, 0.2, 0.2, with_clipped=False)
    return aggregate_premasked(terms.loss, mask_f, AggMode.TOKEN_MEAN)


def _ppo_api(lp: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """Plain PPO token-mean through the public API (ppo_surrogate also returns clip flags)."""
    per_tok, _ = ppo_surrogate(lp, x["lp_k"], x["adv"], 0.2, 0.2, mask=x["mask"])
    return aggregate(per_tok, x["mask"], "token-mean", premasked=True)


def _compis(lp: torch.Tensor, x: dict[str, torch.Tensor], *, diagnostics: bool) -> torch.Tensor:
    """CompIS with both sources corrected: engine TIS clip(0, 2), staleness cap 5."""
    cfg = CompISConfig(
        engine_method="clip",
        engine_low=0.0,
        engine_high=2.0,
        staleness_method="cap",
        staleness_high=5.0,
        diagnostics=diagnostics,
    )
    inputs = LossInputs(
        logprobs=lp,
        proximal_logprobs=x["lp_k"],
        rollout_logprobs=x["lp_s"],
        behavior_logprobs=x["lp_m"],
        advantages=x["adv"],
        loss_mask=x["mask"],
    )
    return compis_loss(inputs, cfg).loss


def step(variant: str, x: dict[str, torch.Tensor]) -> float:
    """One forward + backward (temporaries of the forward are freed as in a real trainer);
    returns seconds."""
    lp = x["lp_t"].clone().requires_grad_(True)
    t0 = time.perf_counter()
    if variant == "ppo":
        loss = _ppo_fused(lp, x)
    elif variant == "ppo-api":
        loss = _ppo_api(lp, x)
    else:
        loss = _compis(lp, x, diagnostics=variant == "compis+d")
    loss.backward()
    return time.perf_counter() - t0


def _peak_rss_kib() -> int:
    """VmHWM of this process (per address space; unlike ru_maxrss it does not inherit the
    parent's peak across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _clear_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux `clear_refs` 5); False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(variant: str, n_tokens: int, seq_len: int) -> None:
    """Subprocess body: peak RSS growth of one forward + backward above the inputs (after one
    warm-up step, so one-time allocations of torch/autograd are not counted)."""
    torch.set_num_threads(1)
    x = make_inputs(n_tokens, seq_len)
    step(variant, x)
    _clear_peak()
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
        "--repeats", type=int, default=30, help="timed repeats per variant (interleaved)"
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
    order = list(VARIANTS)
    rng = random.Random(0)
    for _ in range(args.repeats):  # interleaved, shuffled: machine noise hits every variant alike
        rng.shuffle(order)
        for v in order:
            times[v].append(step(v, x))
    mem = {v: measure_memory(v, args.tokens, args.seq_len) for v in VARIANTS}
    valid = int(x["mask"].sum())
    print(
        f"bench_loss: {args.tokens} tokens ({valid} valid) as [{args.tokens // args.seq_len}, "
        f"{args.seq_len}] fp32, forward+backward, torch threads={args.threads}, "
        f"{args.repeats} interleaved repeats in shuffled order"
    )
    print(
        f"{'variant':<10} {'median ms':>10} {'min ms':>8} {'+ms (min)':>10} {'x ppo':>7} {'x ppo-api':>10} "
        f"{'peak MiB':>9} {'mem x ppo':>10}  goal"
    )
    goals = {
        "ppo": "reference",
        "ppo-api": "",
        "compis": "<= 1.10x time",
        "compis+d": "<= 1.30x time",
    }
    for v in VARIANTS:
        # paired ratios: each repeat's time over the reference's time in the same repeat
        r_ppo = statistics.median(a / b for a, b in zip(times[v], times["ppo"]))
        r_api = statistics.median(a / b for a, b in zip(times[v], times["ppo-api"]))
        print(
            f"{v:<10} {statistics.median(times[v]) * 1e3:10.2f} {min(times[v]) * 1e3:8.2f} "
            f"{(min(times[v]) - min(times['ppo'])) * 1e3:10.2f} "
            f"{r_ppo:7.3f} {r_api:10.3f} {mem[v]:9.1f} {mem[v] / mem['ppo']:10.3f}  {goals[v]}"
        )
    print(
        "ppo = plain PPO token-mean on CompIS's own fused path minus the IS weight (strict); "
        "ppo-api = plain PPO via the public ppo_surrogate + aggregate.\n"
        "x ppo = median over repeats of (variant time / reference time in the same repeat); "
        "peak MiB = peak RSS growth of one step above the inputs, fresh process per variant."
    )


if __name__ == "__main__":
    main()
