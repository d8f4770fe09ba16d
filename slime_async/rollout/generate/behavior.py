"""π_j^Meg for every finished sample, asked of the forward-only role as samples complete.

Owns `BehaviorAnnotate`: wraps the data worker's `generate`; a FINISHED result waits for the
role's log-probs of its whole response (prefix segments included) under the versions that
sampled each token and carries them in its payload as `behavior_logprobs` (one float per
response token, NaN where the role had no value), which `assemble` turns into
`TrainerBatch.behavior_logprobs`. Samples finishing while a request to the role is in flight
are sent together in the next one, so the role runs one forward per version per burst rather
than per sample. The wait is on the rollout side (the sample is admitted a little later), never
on the trainer's. Errors of the role are logged and leave the sample unannotated (the trainer
then falls back for that step, `train/behavior_missing_tokens`).

`take_metrics` says, since it was last called, how busy the role kept the rollout side:
`role/calls`, `role/samples` (samples annotated), `role/busy_s` (seconds a request to the role
was in flight: one is at a time, so `role/busy_s` over the step's seconds near 1 means the role
limits how fast samples are admitted) and `role/failures`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np
import torch

from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.rollout import (
    FinishStatus,
    GenerationRequest,
    GenerationResult,
    SegmentPayload,
    segment_payload,
)

log = logging.getLogger(__name__)

Forward = Callable[[TrainerBatch], Awaitable[np.ndarray]]
"""`forward(batch) -> [B, T]` π_j^Meg per token (the role's `logprobs`)."""


def sample_batch(items: list[tuple[GenerationRequest, GenerationResult]]) -> TrainerBatch:
    """The `TrainerBatch` of finished samples (prompt + every segment), response tokens trained,
    with the engine's routing of the whole sequence when every sample carries it (R3)."""
    seqs, prompts, versions, routed = [], [], [], []
    for req, res in items:
        p = list(req.prompt.prompt_ids)
        resp = [*req.prefix_ids, *res.output_ids]
        seqs.append(p + resp)
        prompts.append(len(p))
        versions.append([*req.prefix_versions, *res.token_versions])
        experts = segment_payload(res.payload).get("routed_experts")
        ok = experts is not None and experts.shape[0] == len(p) + len(resp) - 1
        routed.append(experts if ok else None)
    n, width = len(seqs), max(len(s) for s in seqs)
    tokens = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    ver = torch.full((n, width), -1, dtype=torch.long)
    for i, (s, p, v) in enumerate(zip(seqs, prompts, versions, strict=True)):
        tokens[i, : len(s)] = torch.as_tensor(s)
        mask[i, p : len(s)] = True
        ver[i, p : len(s)] = torch.as_tensor(v, dtype=torch.long)
    zeros = torch.zeros(n, width)
    return TrainerBatch(
        tokens=tokens,
        lengths=torch.as_tensor([len(s) for s in seqs]),
        loss_mask=mask,
        rollout_logprobs=zeros,
        advantages=zeros,
        token_versions=ver,
        routed_experts=tuple(routed) if all(r is not None for r in routed) else None,
    )


class BehaviorAnnotate:
    """`generate` whose finished samples carry π_j^Meg (`payload["behavior_logprobs"]`)."""

    def __init__(self, generate: Callable[..., Awaitable[GenerationResult]], forward: Forward):
        self._generate, self._forward = generate, forward
        self._queue: list[tuple[GenerationRequest, GenerationResult, asyncio.Future]] = []
        self._drain: asyncio.Task | None = None
        self.failures = 0
        """Role requests that failed (their samples went unannotated)."""
        self.calls = 0
        self.samples = 0
        self.busy_s = 0.0
        """Seconds a request to the role was in flight (all requests, one at a time)."""
        self._taken = (0, 0, 0.0, 0)

    def take_metrics(self) -> dict[str, float]:
        """`role/*` since the last call (see the module docstring)."""
        now = (self.calls, self.samples, self.busy_s, self.failures)
        d = [a - b for a, b in zip(now, self._taken, strict=True)]
        self._taken = now
        names = ("role/calls", "role/samples", "role/busy_s", "role/failures")
        return {k: float(v) for k, v in zip(names, d, strict=True)}

    async def __call__(
        self, req: GenerationRequest, priority: float, expected_len: int
    ) -> GenerationResult:
        res = await self._generate(req, priority, expected_len)
        if res.status is not FinishStatus.FINISHED or not (req.prefix_ids or res.output_ids):
            return res
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queue.append((req, res, fut))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.ensure_future(self._run())
        lps = await fut
        if lps is None:
            return res
        payload: SegmentPayload = {**segment_payload(res.payload), "behavior_logprobs": lps}
        return dataclasses.replace(res, payload=payload)

    async def _run(self) -> None:
        while self._queue:
            items, self._queue = self._queue, []
            t0 = time.perf_counter()
            self.calls += 1
            self.samples += len(items)
            try:
                batch = sample_batch([(r, g) for r, g, _ in items])
                lp = await self._forward(batch)
            except Exception as e:  # the role failed: the trainer falls back for these
                self.failures += 1
                log.warning("forward-only role failed on %d samples: %s", len(items), e)
                for *_, fut in items:
                    if not fut.done():
                        fut.set_result(None)
                continue
            finally:
                self.busy_s += time.perf_counter() - t0
            for i, (req, res, fut) in enumerate(items):
                p = len(req.prompt.prompt_ids)
                r = len(req.prefix_ids) + len(res.output_ids)
                if not fut.done():
                    fut.set_result([float(x) for x in lp[i, p : p + r]])
