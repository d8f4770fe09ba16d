"""From completed groups to the trainer's batch: scoring, advantages, padded tensors.

Owns `ScoredGenerate` (wraps the generate client: a finished sample is scored once, its reward
stored in its payload, so group filters such as DAPO's see rewards) and `assemble` (a data-worker
`Batch` -> `TrainerBatch` + rollout metrics). Samples whose reward could not be computed, and
tokens whose engine log-prob was not finite, are masked out of the loss and counted here.
Advantages come from `loss`'s estimator registry (`loss.compute_advantages`, by name);
this module only arranges tensors.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

import loss as adv
from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.rollout import (
    Batch,
    FinishStatus,
    GenerationRequest,
    GenerationResult,
    Group,
)
from slime_async.rollout.rewards import RewardInput, RewardResult, RewardStatus, compute_reward

Generate = Callable[[GenerationRequest, float, int], Any]


class ScoredGenerate:
    """`generate` that also scores finished samples: payload gains `reward`, `reward_status`."""

    def __init__(
        self,
        generate: Generate,
        reward_fn: Callable[[RewardInput], Any],
        *,
        eos_id: int,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self._generate, self._reward_fn = generate, reward_fn
        self._eos, self._decode = eos_id, decode
        self.reward_failures = 0
        """Samples whose reward raised or was not finite (masked from the loss)."""
        self._inflight, self._idle_total = 0, 0.0
        self._idle_since: float | None = time.perf_counter()

    def idle_seconds(self) -> float:
        """Total time so far with no generate call in flight (the rollout side had no work)."""
        ongoing = 0.0 if self._idle_since is None else time.perf_counter() - self._idle_since
        return self._idle_total + ongoing

    async def __call__(
        self, req: GenerationRequest, priority: float, expected_len: int
    ) -> GenerationResult:
        if self._inflight == 0 and self._idle_since is not None:
            self._idle_total += time.perf_counter() - self._idle_since
            self._idle_since = None
        self._inflight += 1
        try:
            return await self._score(req, priority, expected_len)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle_since = time.perf_counter()

    async def _score(
        self, req: GenerationRequest, priority: float, expected_len: int
    ) -> GenerationResult:
        res: GenerationResult = await self._generate(req, priority, expected_len)
        if res.status is not FinishStatus.FINISHED:
            return res
        response = [*req.prefix_ids, *res.output_ids]
        label = req.prompt.payload.get("label")
        inp = RewardInput(
            response_ids=response,
            label=label,
            prompt_ids=tuple(req.prompt.prompt_ids),
            response_text=self._decode(response) if self._decode is not None else None,
            eos_id=self._eos,
            truncated=(not response or response[-1] != self._eos),
            metadata=req.prompt.payload.get("metadata") or {},
        )
        result: RewardResult = await compute_reward(self._reward_fn, inp)
        if result.masked:
            self.reward_failures += 1
        payload = {**res.payload, "reward": result.reward, "reward_status": str(result.status)}
        return dataclasses.replace(res, payload=payload)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Assembled:
    """A train batch plus what the controller logs about it."""

    batch: TrainerBatch
    metrics: dict[str, float]


def _concat(sample_payloads: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
    out: list[Any] = []
    for p in sample_payloads:
        out.extend(p.get(key, ()))
    return out


def assemble(batch: Batch, *, estimator: str) -> Assembled:
    """Build the padded `TrainerBatch` of a consumed batch (prompt + response per sample)."""
    rows: list[tuple[Group, Any]] = [(g, s) for g in batch.groups for s in g.samples]
    n = len(rows)
    lengths = [len(g.prompt.prompt_ids) + len(s.output_ids) for g, s in rows]
    width = max(lengths)
    tokens = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    rollout_lp = torch.zeros(n, width)
    versions = torch.full((n, width), -1, dtype=torch.long)
    rewards = torch.zeros(n)
    valid = torch.ones(n, dtype=torch.bool)
    routed: list[np.ndarray] | None = []
    truncated = nonfinite = 0
    for i, (g, s) in enumerate(rows):
        p, r = len(g.prompt.prompt_ids), len(s.output_ids)
        tokens[i, :p] = torch.as_tensor(list(g.prompt.prompt_ids))
        tokens[i, p : p + r] = torch.as_tensor(list(s.output_ids))
        lps = _concat(s.payloads, "logprobs")
        bad = _concat(s.payloads, "nonfinite")
        if len(lps) != r:
            raise ValueError(
                f"sample {g.prompt.key}/{s.sample_index}: {r} tokens but {len(lps)} log-probs"
            )
        rollout_lp[i, p : p + r] = torch.as_tensor(lps, dtype=torch.float32)
        versions[i, p : p + r] = torch.as_tensor(list(s.token_versions))
        m = torch.ones(r, dtype=torch.bool)
        if any(bad):
            m &= ~torch.as_tensor(bad, dtype=torch.bool)
            nonfinite += int(sum(bad))
        status = s.payload.get("reward_status", str(RewardStatus.OK))
        if status != str(RewardStatus.OK):
            valid[i] = False
            m[:] = False
        mask[i, p : p + r] = m
        rewards[i] = float(s.payload.get("reward", 0.0))
        truncated += int(s.payload.get("finish") == "length")
        experts = s.payload.get("routed_experts")
        if routed is not None and experts is not None and experts.shape[0] == lengths[i] - 1:
            routed.append(experts)
        else:
            routed = None
    group_ids = torch.as_tensor([gi for gi, g in enumerate(batch.groups) for _ in g.samples])
    token_adv = adv.compute_advantages(estimator, rewards, group_ids, valid, mask).float()
    tb = TrainerBatch(
        tokens=tokens,
        lengths=torch.as_tensor(lengths),
        loss_mask=mask,
        rollout_logprobs=rollout_lp,
        advantages=token_adv,
        token_versions=versions,
        routed_experts=tuple(routed) if routed else None,
    )
    resp_len = torch.as_tensor([len(s.output_ids) for _, s in rows], dtype=torch.float32)
    lp_mean = (rollout_lp * mask).sum() / mask.sum().clamp(min=1)
    metrics = {
        "rollout/reward": float(rewards[valid].mean()) if bool(valid.any()) else 0.0,
        "rollout/length": float(resp_len.mean()),
        "rollout/logprob_mean": float(lp_mean),
        "rollout/truncated_frac": truncated / max(1, n),
        "rollout/reward_masked": float((~valid).sum()),
        "rollout/nonfinite_logprobs": float(nonfinite),
        "rollout/samples": float(n),
        "rollout/routed_experts_frac": 1.0 if routed else 0.0,
    }
    return Assembled(batch=tb, metrics=metrics)
