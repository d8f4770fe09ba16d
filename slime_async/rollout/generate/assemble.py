"""From completed groups to the trainer's batch: scoring, advantages, padded tensors.
One responsibility over 400 lines: turning generated samples into what the trainer trains.

Owns `ScoredGenerate` (wraps the generate client: a finished sample is scored once, its reward
stored in its payload, so group filters such as DAPO's see rewards; with slime's `--group-rm`
whole groups are scored when a step consumes them, `score_groups`) and `assemble` (a data-worker
`Batch` -> `TrainerBatch` + rollout metrics). A reward function that raises stops the run with
`RewardError` naming the function and the sample; samples whose reward was not finite, tokens
whose engine log-prob was not finite, and tokens a multi-turn rollout marked as tool output
(payload `loss_mask` 0) are masked out of the loss and counted here. DAPO's soft over-long
penalty (`Overlong`, `--overlong-buffer-len`) is added to the rewards here, before the
advantages (group filters such as `--dynamic-sampling` saw the unshaped rewards).
Advantages come from `loss`'s estimator registry (`loss.compute_advantages`, by name);
this module only arranges tensors.
"""

from __future__ import annotations

import asyncio
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
    SegmentPayload,
    segment_payload,
)
from slime_async.contracts.vision import ImageRefs
from slime_async.rollout.config import RolloutConfig
from slime_async.rollout.data.rewards import (
    RewardError,
    RewardInput,
    RewardResult,
    RewardStatus,
    compute_group_rewards,
    compute_reward,
    function_name,
)

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
        reward_args: Any = None,
        group_rm: bool = False,
        score_alone: bool = False,
    ) -> None:
        self._generate, self._reward_fn = generate, reward_fn
        self._eos, self._decode = eos_id, decode
        self.reward_args, self.group_rm = reward_args, group_rm
        self._alone = score_alone  # a group reward on each sample as a group of one (eval)
        self.reward_failures = 0
        """Samples whose reward was not finite (masked from the loss)."""
        self._inflight, self._idle_total = 0, 0.0
        self._idle_since: float | None = time.perf_counter()

    def scoring_alone(
        self,
        *,
        generate: Generate | None = None,
        reward_fn: Callable[[RewardInput], Any] | None = None,
    ) -> ScoredGenerate:
        """A fresh copy (same settings; `generate` and `reward_fn` when given, else the same)
        that scores every finished sample on its own, a group reward seeing a group of one
        (evaluation)."""
        return ScoredGenerate(
            generate or self._generate,
            reward_fn or self._reward_fn,
            eos_id=self._eos,
            decode=self._decode,
            reward_args=self.reward_args,
            group_rm=self.group_rm,
            score_alone=True,
        )

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
        if res.status is not FinishStatus.FINISHED or (self.group_rm and not self._alone):
            return res  # --group-rm: scored with its group when a step consumes it
        if "reward" in res.payload:
            return res  # scored by the generate link (an agent's reward, a failed episode)
        payloads = [segment_payload(p) for p in (*req.prefix_payloads, res.payload)]
        inp = self._input(
            req.prompt, req.sample_index, [*req.prefix_ids, *res.output_ids], payloads
        )
        if self.group_rm:
            (got,) = await compute_group_rewards(self._reward_fn, [inp], args=self.reward_args)
        else:
            got = await compute_reward(self._reward_fn, inp, args=self.reward_args)
        result = self._check(got, inp)
        return dataclasses.replace(res, payload=_scored(res.payload, result))

    def _input(
        self, prompt: Any, index: int, response: list[int], payloads: Sequence[SegmentPayload]
    ) -> RewardInput:
        mask = _concat(payloads, "loss_mask") if any("loss_mask" in p for p in payloads) else None
        decode = self._decode
        return RewardInput(
            response_ids=response,
            label=prompt.payload.get("label"),
            prompt_ids=tuple(prompt.prompt_ids),
            response_text=decode(response) if decode is not None else None,
            prompt_text=decode(list(prompt.prompt_ids)) if decode is not None else None,
            eos_id=self._eos,
            truncated=(not response or response[-1] != self._eos),
            metadata=prompt.payload.get("metadata") or {},
            prompt_key=prompt.key,
            sample_index=index,
            loss_mask=mask,
        )

    def _check(self, result: RewardResult, inp: RewardInput) -> RewardResult:
        if result.status is RewardStatus.ERROR:
            raise RewardError(
                f"reward function {function_name(self._reward_fn)} raised on {inp.describe()}: "
                f"{result.error}"
            )
        if result.masked:
            self.reward_failures += 1
        return result

    async def score_groups(self, batch: Batch) -> Batch:
        """slime's `--group-rm`: score each group of `batch` with one call (no-op otherwise)."""
        if not self.group_rm:
            return batch
        groups = await asyncio.gather(*(self._score_group(g) for g in batch.groups))
        return dataclasses.replace(batch, groups=tuple(groups))

    async def _score_group(self, g: Group) -> Group:
        inps = [
            self._input(g.prompt, s.sample_index, list(s.output_ids), _payloads(s))
            for s in g.samples
        ]
        results = await compute_group_rewards(
            self._reward_fn, inps, args=self.reward_args, group_index=g.seq
        )
        samples = []
        for s, inp, r in zip(g.samples, inps, results, strict=True):
            r = self._check(r, inp)
            last = _scored(s.payloads[-1], r)
            samples.append(dataclasses.replace(s, payloads=(*s.payloads[:-1], last)))
        return dataclasses.replace(g, samples=tuple(samples))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Overlong:
    """DAPO's soft over-long punishment (`loss.overlong_penalty`): a response longer than
    `max_len - buffer_len` tokens loses `factor` x (its excess / `buffer_len`) of reward, up to
    `factor` at `max_len`.

    Example: max_len 20, buffer_len 4, factor 1: lengths 16, 18, 20 lose 0, 0.5, 1.0."""

    max_len: int
    """L_max: the most new tokens a response may have (`--rollout-max-response-len`)."""
    buffer_len: int
    """L_buffer (`--overlong-buffer-len`): the punished last tokens before L_max."""
    factor: float
    """Penalty at L_max (`--overlong-penalty-factor`)."""


def overlong_shaping(rollout: RolloutConfig) -> Overlong | None:
    """The over-long shaping of `rollout`'s flags; None when `--overlong-buffer-len` is 0."""
    if not rollout.overlong_buffer_len:
        return None
    return Overlong(
        max_len=rollout.max_response_len,
        buffer_len=rollout.overlong_buffer_len,
        factor=rollout.overlong_penalty_factor,
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Assembled:
    """A train batch plus what the controller logs about it."""

    batch: TrainerBatch
    metrics: dict[str, float]


def _scored(payload: Mapping[str, Any], result: RewardResult) -> SegmentPayload:
    """The sample's last segment payload with its reward."""
    return {
        **segment_payload(payload),
        "reward": result.reward,
        "reward_status": str(result.status),
    }


def _payloads(sample: Any) -> list[SegmentPayload]:
    """A data-worker sample's payloads, one per generate segment, as what they are."""
    return [segment_payload(p) for p in sample.payloads]


def _concat(sample_payloads: Sequence[SegmentPayload], key: str) -> list[Any]:
    out: list[Any] = []
    for p in sample_payloads:
        out.extend(p.get(key, ()))
    return out


def _concat_mask(payloads: Sequence[SegmentPayload], n: int, *, where: str) -> torch.Tensor:
    """The response's loss mask from its segments' payloads (a segment without `loss_mask` is
    all model tokens): bool `[n]`."""
    parts: list[int] = []
    for p in payloads:
        k = len(p.get("logprobs", ()))
        mask = p.get("loss_mask")
        parts.extend([1] * k if mask is None else [int(x) for x in mask])
    if len(parts) != n:
        raise ValueError(f"{where}: {n} tokens but a loss mask of {len(parts)}")
    return torch.as_tensor(parts, dtype=torch.bool)


@dataclasses.dataclass(kw_only=True, slots=True)
class _Padded:
    """The padded tensors of a batch being assembled (`[N, T]`, `[N]`), filled row by row,
    with the counts its metrics report."""

    tokens: torch.Tensor
    mask: torch.Tensor
    rollout_lp: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor
    valid: torch.Tensor
    behavior: torch.Tensor | None
    """π_j^Meg from the forward-only role (`rollout/generate/behavior.py`); NaN where a sample
    has none; None when no sample has any."""
    routed: list[np.ndarray] | None = dataclasses.field(default_factory=list)
    """Per-sample routed experts, None once a sample lacks them."""
    truncated: int = 0
    nonfinite: int = 0
    tool_tokens: int = 0

    @classmethod
    def empty(cls, n: int, width: int, *, with_behavior: bool) -> _Padded:
        return cls(
            tokens=torch.zeros(n, width, dtype=torch.long),
            mask=torch.zeros(n, width, dtype=torch.bool),
            rollout_lp=torch.zeros(n, width),
            versions=torch.full((n, width), -1, dtype=torch.long),
            rewards=torch.zeros(n),
            valid=torch.ones(n, dtype=torch.bool),
            behavior=torch.full((n, width), float("nan")) if with_behavior else None,
        )

    def fill(self, i: int, g: Group, s: Any, length: int) -> None:
        """Row `i`: prompt + response of sample `s` of group `g` (`length` tokens)."""
        p, r = len(g.prompt.prompt_ids), len(s.output_ids)
        segments = _payloads(s)
        last = segments[-1]
        where = f"sample {g.prompt.key}/{s.sample_index}"
        self.tokens[i, :p] = torch.as_tensor(list(g.prompt.prompt_ids))
        self.tokens[i, p : p + r] = torch.as_tensor(list(s.output_ids))
        lps = _concat(segments, "logprobs")
        if len(lps) != r:
            raise ValueError(f"{where}: {r} tokens but {len(lps)} log-probs")
        self.rollout_lp[i, p : p + r] = torch.as_tensor(lps, dtype=torch.float32)
        self.versions[i, p : p + r] = torch.as_tensor(list(s.token_versions))
        if self.behavior is not None:
            blp = last.get("behavior_logprobs", ())
            if len(blp) == r:
                self.behavior[i, p : p + r] = torch.as_tensor(blp, dtype=torch.float32)
        m = self._response_mask(segments, r, where=where)
        if last.get("reward_status", str(RewardStatus.OK)) != str(RewardStatus.OK):
            self.valid[i] = False
            m[:] = False
        self.mask[i, p : p + r] = m
        self.rewards[i] = float(last.get("reward", 0.0))
        self.truncated += int(last.get("finish") == "length")
        experts = last.get("routed_experts")
        if self.routed is not None and experts is not None and experts.shape[0] == length - 1:
            self.routed.append(experts)
        else:
            self.routed = None

    def _response_mask(
        self, segments: Sequence[SegmentPayload], r: int, *, where: str
    ) -> torch.Tensor:
        """The `[r]` loss mask of a response: tool output (multi-turn) and tokens with a
        non-finite engine log-prob are not trained (both counted)."""
        m = torch.ones(r, dtype=torch.bool)
        if any("loss_mask" in p for p in segments):  # multi-turn: tool output is not trained
            keep = _concat_mask(segments, r, where=where)
            self.tool_tokens += int((~keep).sum())
            m &= keep
        bad = _concat(segments, "nonfinite")
        if any(bad):
            m &= ~torch.as_tensor(bad, dtype=torch.bool)
            self.nonfinite += int(sum(bad))
        return m

    def metrics(self, response_lengths: Sequence[int]) -> dict[str, float]:
        """The rollout metrics of the filled batch."""
        n, valid, mask = len(response_lengths), self.valid, self.mask
        resp_len = torch.as_tensor(response_lengths, dtype=torch.float32)
        lp_mean = (self.rollout_lp * mask).sum() / mask.sum().clamp(min=1)
        return {
            "rollout/reward": float(self.rewards[valid].mean()) if bool(valid.any()) else 0.0,
            "rollout/length": float(resp_len.mean()),
            "rollout/logprob_mean": float(lp_mean),
            "rollout/truncated_frac": self.truncated / max(1, n),
            "rollout/reward_masked": float((~valid).sum()),
            "rollout/nonfinite_logprobs": float(self.nonfinite),
            "rollout/tool_tokens": float(self.tool_tokens),
            "rollout/samples": float(n),
            "rollout/routed_experts_frac": 1.0 if self.routed else 0.0,
        }


def assemble(
    batch: Batch,
    *,
    estimator: str,
    overlong: Overlong | None = None,
    normalize_rewards: bool = True,
    whiten: bool = False,
) -> Assembled:
    """Build the padded `TrainerBatch` of a consumed batch (prompt + response per sample);
    with `overlong`, DAPO's over-long penalty is added to each scored sample's reward first;
    `normalize_rewards` / `whiten`: `loss.compute_advantages`'s (slime's
    --disable-rewards-normalization and --normalize-advantages)."""
    rows: list[tuple[Group, Any]] = [(g, s) for g in batch.groups for s in g.samples]
    n = len(rows)
    lengths = [len(g.prompt.prompt_ids) + len(s.output_ids) for g, s in rows]
    t = _Padded.empty(
        n,
        max(lengths),
        with_behavior=any("behavior_logprobs" in s.payloads[-1] for _, s in rows),
    )
    for i, (g, s) in enumerate(rows):
        t.fill(i, g, s, lengths[i])
    if n and not bool(t.mask.any()):
        raise ValueError(
            f"no token of this batch can be trained: {int((~t.valid).sum())} of {n} samples "
            f"have a non-finite reward, {t.nonfinite} tokens a non-finite engine log-prob, "
            f"{t.tool_tokens} are tool output; check the reward function (--custom-rm-path) "
            "and the engines"
        )
    metrics = t.metrics([len(s.output_ids) for _, s in rows])
    if overlong is not None:
        metrics |= _shape_overlong(t, [len(s.output_ids) for _, s in rows], overlong)
    group_ids = torch.as_tensor([gi for gi, g in enumerate(batch.groups) for _ in g.samples])
    token_adv = adv.compute_advantages(
        estimator,
        t.rewards,
        group_ids,
        t.valid,
        t.mask,
        normalize_rewards=normalize_rewards,
        whiten_advantages=whiten,
    ).float()
    tb = TrainerBatch(
        tokens=t.tokens,
        lengths=torch.as_tensor(lengths),
        loss_mask=t.mask,
        rollout_logprobs=t.rollout_lp,
        advantages=token_adv,
        token_versions=t.versions,
        routed_experts=tuple(t.routed) if t.routed else None,
        behavior_logprobs=t.behavior,
        images=_image_refs(rows),
    )
    return Assembled(batch=tb, metrics=metrics)


def _image_refs(rows: list[tuple[Group, Any]]) -> tuple[ImageRefs | None, ...] | None:
    """Each sample's images by reference (its prompt's `images`), None without any: the
    trainer preprocesses them itself, no pixels cross the process boundary."""
    refs = [g.prompt.payload.get("images") for g, _ in rows]
    if not any(refs):
        return None
    return tuple(ImageRefs(refs=tuple(r)) if r else None for r in refs)


def _shape_overlong(t: _Padded, lengths: Sequence[int], overlong: Overlong) -> dict[str, float]:
    """Add the over-long penalty to the scored samples' rewards of `t` (in place); its metrics:
    the mean penalty and the fraction of scored samples punished."""
    pen = adv.overlong_penalty(
        torch.as_tensor(lengths),
        max_len=overlong.max_len,
        buffer_len=overlong.buffer_len,
        factor=overlong.factor,
    ).to(t.rewards.dtype)
    pen = torch.where(t.valid, pen, torch.zeros_like(pen))
    t.rewards += pen
    n = max(1, int(t.valid.sum()))
    return {
        "rollout/overlong_penalty": float(pen.sum()) / n,
        "rollout/overlong_frac": float((pen < 0).sum()) / n,
    }
