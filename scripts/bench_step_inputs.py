"""Train-step time of plain PPO and CompIS by where π_k and π_j^Meg come from, paired in one process.

One trainer (the embedded default: tiny MoE, R3 routing replay, 32 samples of the default
workload's lengths, micro-batches of 16, one thread) takes steps round-robin in five modes, so
every mode sees the same load on this shared machine (a sample's tokens share one version,
k − S or k − S + 1: the steady state of a trainer-bound pipeline at budget S):

  ppo                plain PPO: no π_k forward, no snapshot forward (this tree)
  ppo-before         plain PPO as before this change: with the π_k forward
  compis-role        CompIS reading π_j^Meg from the batch, as the forward-only role delivers it
                     (the role's work is done outside the timed step: it runs on the rollout side)
  compis-trainer     CompIS with snapshot forwards in the step, no π_k forward (this tree)
  compis-before      CompIS as before this change: π_k forward + snapshot forwards (forced here
                     with the one config that still needs the π_k forward, denom=drop + cap)

and prints the median `timing/train_step_s` of each and its ratio to plain PPO's, per S.

    .venv/bin/python scripts/bench_step_inputs.py --staleness 2 8 16 --reps 8
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--staleness", nargs="*", type=int, default=[2, 8, 16])
    p.add_argument("--reps", type=int, default=8, help="Timed steps per mode and S.")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from loss import LossSelection, denominators, get_loss_spec
    from slime_async.contracts.model import TINY_MOE
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.replay import RoutingReplay
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    smax = max(args.staleness)
    cfg = TrainerConfig(
        lr=1e-4,
        seed=0,
        micro_batch_size=16,
        routing_replay=RoutingReplay.R3,
        keep_old_actor=True,
        max_snapshots=smax + 2,
        loss=LossSelection(name="compis"),
    )
    tr = MegatronTrainer(cfg, TINY_MOE)
    compis_spec, compis_cfg = tr.loss_spec, tr.loss_cfg
    before_cfg = dataclasses.replace(compis_cfg, denom="drop", staleness_method="cap")
    ppo_spec = get_loss_spec("ppo")
    ppo_cfg = ppo_spec.config(None)
    # PPO as before this change: the π_k forward ran for every loss (forced here by a
    # denominator function that reads log-probs and returns the mask's counts)
    ppo_before = dataclasses.replace(
        ppo_spec,
        needs=dataclasses.replace(
            ppo_spec.needs, denominators=lambda i, c: denominators(i.loss_mask)
        ),
    )
    g = torch.Generator().manual_seed(0)
    # the default workload's shapes: prompts of ~8 tokens, answers of 3-12
    lengths = [8 + int(x) for x in torch.randint(3, 13, (32,), generator=g)]

    def batch(s: int, seed: int):
        b = random_batch(
            TINY_MOE, batch=32, width=max(lengths), prompt=8, seed=seed, lengths=lengths
        )
        # a sample's tokens share a version; a trainer-bound pipeline at budget S trains
        # samples of k - S and k - S + 1
        lo = max(0, tr.version - s)
        ver = torch.randint(lo, min(lo + 2, tr.version + 1), (b.size, 1), generator=g)
        ver = ver.expand_as(b.token_versions)
        rng = torch.Generator().manual_seed(seed)
        nl, k, e = TINY_MOE.num_layers, TINY_MOE.moe_topk, TINY_MOE.num_experts
        experts = tuple(
            torch.stack([torch.randperm(e, generator=rng)[:k] for _ in range((n - 1) * nl)])
            .reshape(n - 1, nl, k)
            .numpy()
            for n in b.lengths.tolist()
        )
        return dataclasses.replace(
            b, token_versions=torch.where(b.loss_mask, ver, -1), routed_experts=experts
        )

    def step(mode: str, b) -> float:
        tr.loss_spec, tr.loss_cfg = compis_spec, compis_cfg
        tr.cfg = dataclasses.replace(cfg, behavior_forward="trainer")
        if mode == "ppo":  # plain PPO keeps no snapshots
            tr.loss_spec, tr.loss_cfg = ppo_spec, ppo_cfg
            tr.cfg = dataclasses.replace(cfg, keep_old_actor=False)
        elif mode == "ppo-before":
            tr.loss_spec, tr.loss_cfg = ppo_before, ppo_cfg
            tr.cfg = dataclasses.replace(cfg, keep_old_actor=False)
        elif mode == "compis-role":
            lp_j = tr.compute_behavior_logprobs(b)  # the role's job, off the step
            b = dataclasses.replace(b, behavior_logprobs=lp_j)
            tr.cfg = dataclasses.replace(cfg, behavior_forward="role")
        elif mode == "compis-before":
            tr.loss_cfg = before_cfg
        m = tr.train_step(b)
        tr.cfg = dataclasses.replace(cfg, behavior_forward="trainer")
        tr.snapshots.snapshot(tr.model, tr.version)  # every mode keeps the store complete
        return m["timing/train_step_s"]

    modes = ["ppo", "ppo-before", "compis-role", "compis-trainer", "compis-before"]
    for _ in range(smax + 1):  # fill the snapshot store with the versions a batch can need
        step("ppo", batch(0, 0))
    a, b_, c = os.getloadavg()
    print(f"load before {a:.1f} {b_:.1f} {c:.1f}", flush=True)
    rows = []
    for s in args.staleness:
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.reps + 1):
            for mode in modes:
                t = step(mode, batch(s, 100 * s + r))
                if r:  # the first round warms up
                    times[mode].append(t)
        med = {m: statistics.median(v) for m, v in times.items()}
        rows.append((s, med))
        line = ", ".join(f"{m} {med[m]:.3f} s ({med[m] / med['ppo']:.2f}x)" for m in modes)
        print(f"S={s}: {line}", flush=True)
    a, b_, c = os.getloadavg()
    print(f"load after {a:.1f} {b_:.1f} {c:.1f}")
    print("\n| S | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes))
    for s, med in rows:
        cells = " | ".join(f"{med[m]:.3f} s ({med[m] / med['ppo']:.2f}x)" for m in modes)
        print(f"| {s} | {cells} |")
    tr.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
