"""Benchmark: engine mismatch with and without R3, and the step-time cost of R3.

One run, one model: a Qwen3-MoE-style model is first trained a few steps (advantage +1 on
structured sequences, so its next-token distributions get peaky), exported to an HF directory,
and sampled by a bf16 HF "engine" that records its MoE routing per token (`[T−1, L, K]`,
as SGLang's `routed_experts`). On the same sampled tokens the fp32 Megatron trainer computes
log-probs with its own routing and with the engine's routing replayed (R3):

  (1) mean / p99 / max |Δ log-prob| (trainer fp32 vs engine bf16), reduction with R3 (%);
  (2) train-step time with R3 vs without (alternating steps, medians), overhead (%).

Prints ratios measured in this one run (the machine may be noisy). Uses CUDA when present.

    .venv/bin/python scripts/bench_routing_replay.py            # default model (~13M params)
    .venv/bin/python scripts/bench_routing_replay.py --tiny     # the embedded 2M TINY_MOE
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree

from slime_async.contracts.model import TINY_MOE, ModelSpec


def structured_batch(spec: ModelSpec, *, batch: int, width: int, prompt: int, seed: int):
    """Arithmetic sequences mod V (learnable → peaky after a few steps), advantage +1."""
    from slime_async.contracts.batch import TrainerBatch

    g = np.random.default_rng(seed)
    toks = []
    for _ in range(batch):
        start, stride = int(g.integers(spec.vocab_size)), int(g.integers(1, 8))
        toks.append([(start + i * stride) % spec.vocab_size for i in range(width)])
    n = width - prompt
    return TrainerBatch.from_lists(
        tokens=toks,
        prompt_lengths=[prompt] * batch,
        rollout_logprobs=[[-float(np.log(spec.vocab_size))] * n] * batch,
        advantages=[1.0] * batch,
        versions=[0] * batch,
    )


def stats(x: torch.Tensor) -> dict[str, float]:
    a = x.double().cpu().numpy()
    return {"mean": float(a.mean()), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="use the embedded TINY_MOE spec")
    ap.add_argument("--warm-steps", type=int, default=30, help="training steps before measuring")
    ap.add_argument("--prompts", type=int, default=16, help="sampled sequences")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--timing-steps", type=int, default=10, help="timed steps per mode")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.replay import RoutingReplay, capture_routing, engine_routing_to_replay
    from slime_async.trainer.testing import hf_sample, load_hf, rollout_batch
    from slime_async.trainer.trainer import MegatronTrainer

    spec = (
        TINY_MOE
        if args.tiny
        else ModelSpec(
            hidden_size=256,
            num_layers=4,
            num_experts=8,
            moe_topk=2,
            moe_intermediate_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            init_std=0.05,
        )
    )
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # padded layout: the routing maps below are read as seq-major [T * b, E] per micro-batch
    cfg = TrainerConfig(lr=3e-3, micro_batch_size=8, seed=0, qkv_format="bshd")
    tr = MegatronTrainer(cfg, spec)
    n_params = sum(p.numel() for p in tr.model.parameters())
    print(
        f"device={dev} params={n_params / 1e6:.1f}M layers={spec.num_layers} "
        f"experts={spec.num_experts} top{spec.moe_topk}"
    )
    warm = structured_batch(spec, batch=16, width=64, prompt=8, seed=1)
    t0 = time.perf_counter()
    for _ in range(args.warm_steps):
        m = tr.train_step(warm)
    print(
        f"warm-up: {args.warm_steps} steps in {time.perf_counter() - t0:.1f}s, "
        f"entropy {m['policy/entropy']:.3f} (uniform {np.log(spec.vocab_size):.2f})"
    )

    with tempfile.TemporaryDirectory() as d:
        engine = load_hf(tr.save_weights(f"{d}/w"), torch.bfloat16).to(dev)
        prompts = structured_batch(
            spec, batch=args.prompts, width=args.prompt_len, prompt=1, seed=3
        ).tokens
        ro = hf_sample(engine, spec, prompts.to(dev), max_new_tokens=args.new_tokens, seed=11)
    ro = dataclasses.replace(ro, tokens=ro.tokens.cpu(), logprobs=ro.logprobs.cpu())
    batch = rollout_batch(ro, advantages=[1.0 if i % 2 else -1.0 for i in range(args.prompts)])
    mask = batch.loss_mask
    res, maps = {}, {}
    for mode in (RoutingReplay.NONE, RoutingReplay.R3):
        tr.cfg = dataclasses.replace(cfg, routing_replay=mode)
        caps: list[torch.Tensor] = []
        with capture_routing(tr.model, caps):
            lp, _ = tr.compute_logprobs(batch)
        # per layer, per micro-batch seq-major [T*b, E]; drop the last position (the engine
        # never routes it, R3 fills it with synthetic ids)
        nl, width = spec.num_layers, batch.width
        maps[mode] = torch.stack(
            [
                torch.cat([c.view(width, -1, c.shape[-1])[:-1] for c in caps[layer::nl]], 1)
                for layer in range(nl)
            ]
        )
        res[mode] = stats((lp - batch.rollout_logprobs)[mask].abs())
    a, b = res[RoutingReplay.NONE], res[RoutingReplay.R3]
    differ = (maps[RoutingReplay.NONE] != maps[RoutingReplay.R3]).any(-1).float().mean((1, 2))
    print(
        f"tokens compared: {int(mask.sum())} (fp32 trainer vs bf16 engine, same tokens); "
        "trainer top-k set differs from the engine's per layer: "
        + " / ".join(f"{100 * x:.1f}%" for x in differ.tolist())
    )
    for k in ("mean", "p99", "max"):
        red = 100.0 * (1 - b[k] / a[k]) if a[k] > 0 else float("nan")
        print(f"|dlogp| {k:>4}: no-R3 {a[k]:.5f}  R3 {b[k]:.5f}  reduction {red:5.1f}%")

    times: dict[RoutingReplay, list[float]] = {RoutingReplay.NONE: [], RoutingReplay.R3: []}
    for i in range(args.timing_steps + 1):
        for mode in (
            (RoutingReplay.NONE, RoutingReplay.R3)
            if i % 2
            else (RoutingReplay.R3, RoutingReplay.NONE)
        ):
            tr.cfg = dataclasses.replace(cfg, routing_replay=mode)
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            tr.train_step(batch)
            if dev == "cuda":
                torch.cuda.synchronize()
            if i:  # first round is warm-up
                times[mode].append(time.perf_counter() - t)
    for name, agg in (("median", statistics.median), ("min", min)):
        t_none, t_r3 = agg(times[RoutingReplay.NONE]), agg(times[RoutingReplay.R3])
        print(
            f"train step (B={args.prompts}, T={batch.width}) {name} of {args.timing_steps}: "
            f"no-R3 {t_none * 1e3:.1f} ms, R3 {t_r3 * 1e3:.1f} ms, "
            f"R3 overhead {100 * (t_r3 / t_none - 1):+.1f}%"
        )
    t = time.perf_counter()
    for _ in range(20):
        engine_routing_to_replay(batch.routed_experts, spec=spec, width=batch.width)
    prep = (time.perf_counter() - t) / 20
    print(f"R3 replay-index preparation for the whole batch: {prep * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
