"""Size and seconds of one rollout dump (`--save-debug-rollout-data`): a synthetic step of
`--groups` x `--n` samples of `--tokens` tokens after a 200-token prompt, written, read back with
its checksum and rebuilt into the batch; once without routed experts and once with an MoE's
(`--layers` x `--topk`, int32 per token, what R3 keeps). Results:
docs/results/2026-11-27-rollout-dumps.md."""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import numpy as np

from data_worker.types import Batch, Group, Prompt, Sample
from data_worker.versions import VersionRuns
from slime_async.rollout.generate.dump import batch_of, read_dump, write_step

PROMPT = 200


def synthetic(groups: int, n: int, tokens: int, layers: int, topk: int) -> Batch:
    rng = random.Random(0)
    out = []
    for g in range(groups):
        samples = []
        for i in range(n):
            payload = {
                "logprobs": [-rng.random() for _ in range(tokens)],
                "nonfinite": [False] * tokens,
                "finish": "stop",
                "prompt_len": PROMPT,
                "reward": 1.0,
                "reward_status": "ok",
            }
            if layers:
                shape = (PROMPT + tokens - 1, layers, topk)
                payload["routed_experts"] = np.random.randint(0, 128, shape, dtype=np.int32)
            samples.append(
                Sample(
                    sample_index=i,
                    output_ids=[rng.randrange(150_000) for _ in range(tokens)],
                    token_versions=VersionRuns.constant(3, tokens),
                    payloads=(payload,),
                    min_version=3,
                    attempts=1,
                )
            )
        prompt = Prompt(key=f"p{g}", prompt_ids=list(range(PROMPT)), payload={"label": "42"})
        out.append(Group(seq=g, prompt=prompt, samples=tuple(samples), min_version=3,
                         max_version=3, admitted_version=3, completed_at=0.0))  # fmt: skip
    return Batch(groups=tuple(out), dropped=0, filtered=0, current_version=4, wait_s=0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for layers in (0, a.layers):
            batch = synthetic(a.groups, a.n, a.tokens, layers, a.topk)
            t0 = time.perf_counter()
            path = write_step(d, batch, rollout_id=0)
            t1 = time.perf_counter()
            batch_of(read_dump(path))
            t2 = time.perf_counter()
            routed = f"{layers} x {a.topk}" if layers else "none"
            print(
                f"| {a.groups} x {a.n} | {a.tokens} | {routed} | {path.stat().st_size / 1e6:.1f} "
                f"| {t1 - t0:.2f} | {t2 - t1:.2f} |"
            )


if __name__ == "__main__":
    main()
