"""One agent episode: what was sampled, turn by turn, and the trajectory it trains on.

Owns `Episode` (the conversation's ids, loss mask, log-probs and versions, growing one model
turn at a time; `trajectory` is the data worker's result), `Turn` (one model call's exact ids),
`Sampled` (what one model turn returned, over its resumed calls) and `GatewayError` (a call the
gateway refuses). The rules are the gateway's (`gateway.py`, docs/agents.md). Never imports the
trainer, engine or controller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from slime_async.contracts.rollout import FinishStatus, GenerationResult, SegmentPayload
from slime_async.rollout.generate.client import GenerateClient


class GatewayError(ValueError):
    """A call the gateway refuses (HTTP 400, or `status`)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(slots=True)
class Turn:
    """One model call: the exact ids sent and sampled."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str | None
    prefix_mismatch: bool


@dataclasses.dataclass(slots=True)
class Episode:
    """One conversation: what was sampled, in order (the rules: `gateway.py`'s docstring)."""

    id: str
    client: GenerateClient
    """The generate client of this episode (train or eval sampling settings)."""
    data_prompt: tuple[int, ...] = ()
    """The data worker's prompt: the trajectory must start with it."""
    budget: int = 1 << 30
    """Most response tokens after `data_prompt` (model and other tokens)."""
    max_turn_tokens: int | None = None
    """The run's per-turn token limit (None: what is left of `budget`)."""
    ids: list[int] = dataclasses.field(default_factory=list)
    """Everything so far: the first prompt, completions and the prompt tokens between them."""
    first_prompt_len: int = 0
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    """Per token of `ids` after the first prompt: 1 sampled by the model, 0 otherwise."""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    nonfinite: list[bool] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    routed: np.ndarray | None = None
    reward: float | None = None
    prefix_mismatches: int = 0
    overrides: int = 0
    closed: bool = False

    def trajectory(self) -> GenerationResult:
        """The episode as one data-worker result after `data_prompt`: the first prompt's extra
        tokens and each later turn's new prompt tokens masked 0, completions 1."""
        if not self.turns:
            raise GatewayError("the agent made no model call in this episode")
        start = len(self.data_prompt)
        lead = self.first_prompt_len - start
        first_version = self.versions[0] if self.versions else 0
        out = self.ids[start:]
        payload = SegmentPayload(
            logprobs=[0.0] * lead + self.logprobs,
            nonfinite=[False] * lead + self.nonfinite,
            loss_mask=[0] * lead + self.loss_mask,
            finish=self.turns[-1].finish,
            prompt_len=start,
        )
        if self.routed is not None and self.routed.shape[0] == len(self.ids) - 1:
            payload["routed_experts"] = self.routed
        return GenerationResult(
            output_ids=out,
            token_versions=[first_version] * lead + self.versions,
            status=FinishStatus.FINISHED,
            payload=payload,
        )

    def record(self, prompt: list[int], sampled: Sampled, *, mismatch: bool) -> None:
        """Add one model turn: its prompt's new tokens (mask 0; all of it on the first turn),
        then its completion (mask 1, the engine's log-probs and versions)."""
        if not self.turns:
            self.ids = list(prompt)
            self.first_prompt_len = len(prompt)
        else:
            version = self.versions[-1] if self.versions else 0
            self._extend(prompt[len(self.ids) :], mask=0, version=version)
        out = sampled.output_ids
        self.ids += out
        self.loss_mask += [1] * len(out)
        self.logprobs += sampled.logprobs
        self.nonfinite += sampled.nonfinite
        self.versions += sampled.versions
        if sampled.routed is not None:
            self.routed = sampled.routed
        self.turns.append(
            Turn(
                prompt_ids=list(prompt),
                output_ids=list(out),
                logprobs=list(sampled.logprobs),
                versions=list(sampled.versions),
                finish=sampled.finish,
                prefix_mismatch=mismatch,
            )
        )

    def _extend(self, ids: Sequence[int], *, mask: int, version: int) -> None:
        self.ids += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.nonfinite += [False] * len(ids)
        self.versions += [version] * len(ids)


@dataclasses.dataclass(slots=True)
class Sampled:
    """What one model turn sampled (over the calls that resumed it after aborts)."""

    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    nonfinite: list[bool] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None
    text: str = ""
    """The completion as text: the sampled ids decoded with special tokens kept, without the
    stop token, cut at a matched stop string."""
    routed: Any = None
