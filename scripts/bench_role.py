"""Benchmark: what one request to the forward-only role costs, by burst size.

The role (`--behavior-forward role`, CompIS's snapshot form) computes π_j^Meg for the samples
that finished while its previous request was in flight, one forward per version per burst
(`slime_async/rollout/generate/behavior.py`). This builds the role's forwarder in this process
(`BehaviorForwarder`, the recipe's trainer settings, one thread), gives it one version, and
times `logprobs` on bursts of 1 to 32 random samples shaped like the recipe's (prompt and
response lengths given), reporting per call and per sample: wall and CPU seconds, tokens per
CPU second, and the forward's FLOP/s (2·N·tokens, N the parameters a token goes through: every
layer for all tokens, the LM head for response tokens only). The difference between a burst of
1 and the per-sample cost of a large burst is the fixed cost of a request.

    nice -n 10 .venv/bin/python scripts/bench_role.py --hf-checkpoint DIR
    # DIR: an HF directory of the recipe's model, e.g. the run directory's hf_from_gguf/...

Without `--hf-checkpoint` the recipe's own (`hf-checkpoint` in the recipe: the GGUF, converted
once into `--run-dir`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="recipes/smollm2-chain-sum.yaml")
    p.add_argument("--hf-checkpoint", default=None)
    p.add_argument("--run-dir", default="/tmp/bench-role")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--response-tokens", type=int, default=20)
    p.add_argument("--bursts", default="1,2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=3, help="calls per burst size (median)")
    a = p.parse_args()

    import torch

    torch.set_num_threads(1)  # the role's one thread
    from slime_async.config.cli import parse_config
    from slime_async.contracts.batch import TrainerBatch
    from slime_async.trainer.behavior_role import BehaviorForwarder

    argv = ["--config", a.config, "--keep-old-actor", "--run-dir", a.run_dir, "--save-hf", "none"]
    if a.hf_checkpoint:
        argv += ["--hf-checkpoint", a.hf_checkpoint]
    cfg = parse_config(argv)
    fwd = BehaviorForwarder(cfg.trainer, cfg.model, max_versions=2)
    fwd.add_version(0, cfg.trainer.hf_checkpoint)
    n_all = sum(t.numel() for t in fwd.trainer.model.parameters())
    head = cfg.model.vocab_size * cfg.model.hidden_size
    n_body = n_all - head * (1 if cfg.model.tie_word_embeddings else 2)  # no lookup tables
    pt, rt = a.prompt_tokens, a.response_tokens

    def burst(n: int) -> TrainerBatch:
        w = pt + rt
        mask = torch.zeros(n, w, dtype=torch.bool)
        mask[:, pt:] = True
        ver = torch.full((n, w), -1)
        ver[:, pt:] = 0
        zeros = torch.zeros(n, w)
        return TrainerBatch(
            tokens=torch.randint(100, cfg.model.vocab_size, (n, w)),
            lengths=torch.full((n,), w),
            loss_mask=mask,
            rollout_logprobs=zeros,
            advantages=zeros,
            token_versions=ver,
            routed_experts=None,
        )

    fwd.logprobs(burst(2))  # warm-up
    rows = []
    for n in [int(x) for x in a.bursts.split(",")]:
        b, walls, cpus = burst(n), [], []
        for _ in range(a.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            fwd.logprobs(b)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        flop = 2 * n * (n_body * (pt + rt) + head * rt)
        rows.append(
            {
                "burst": n,
                "wall_ms_per_call": round(wall * 1e3, 1),
                "cpu_ms_per_call": round(cpu * 1e3, 1),
                "cpu_ms_per_sample": round(cpu / n * 1e3, 1),
                "tokens_per_cpu_s": round(n * (pt + rt) / cpu),
                "gflops_cpu": round(flop / cpu / 1e9, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    big = rows[-1]["cpu_ms_per_sample"]
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(
        json.dumps(
            {
                "fixed_cpu_ms_per_call": round(rows[0]["cpu_ms_per_call"] - big, 1),
                "load_average": load,
            }
        )
    )


if __name__ == "__main__":
    main()
