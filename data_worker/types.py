"""Data contracts of the RolloutDataWorker.

Owns the value types that cross the worker's boundary: `Prompt` (from a `PromptSource`),
`GenerationRequest` / `GenerationResult` (the `generate` callable's argument and answer),
`Sample` / `Group` / `Batch` (what `get_batch` returns) and `Accounting` (proof that nothing is
lost). Payload dicts are opaque: the worker stores them untouched. Never imports `slime_async`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from clifields import StrEnum
from data_worker.versions import VersionRuns


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Prompt:
    """One prompt of the dataset."""

    key: str
    """Stable per-prompt key (same across epochs): keys the length cache."""
    prompt_ids: Sequence[int]
    """Tokenised prompt."""
    payload: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Opaque data (label, metadata); must be JSON-serialisable for `state_dict`."""
    epoch: int = 0
    """Epoch in which the source emitted this prompt."""
    index: int = 0
    """Position of the prompt in the dataset."""
    extra_work: int = 0
    """Tokens of work each sample costs besides its response (a vision-language prompt's image
    placeholders: a vision forward and their prefill). The length-probe dispatch ranks samples
    on expected response length + `extra_work` and passes the sum as `expected_len`."""

    def __post_init__(self) -> None:
        if not isinstance(self.extra_work, int) or self.extra_work < 0:
            raise ValueError(f"Prompt.extra_work must be an integer >= 0, got {self.extra_work!r}")

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {
            "key": self.key,
            "prompt_ids": list(self.prompt_ids),
            "payload": dict(self.payload),
            "epoch": self.epoch,
            "index": self.index,
            "extra_work": self.extra_work,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Prompt:
        """Inverse of `to_json`."""
        return cls(
            key=str(d["key"]),
            prompt_ids=list(d["prompt_ids"]),
            payload=dict(d.get("payload", {})),
            epoch=int(d.get("epoch", 0)),
            index=int(d.get("index", 0)),
            extra_work=int(d.get("extra_work", 0)),
        )


class FinishStatus(StrEnum):
    """How a generate call ended."""

    FINISHED = "finished"
    """The response is complete (EOS or length limit)."""
    ABORTED = "aborted"
    """Stopped early (pause / abort); `output_ids` holds the partial tokens."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GenerationRequest:
    """What the worker asks `generate` for: one sample of one group."""

    prompt: Prompt
    """The prompt (ids, key, payload)."""
    group_seq: int
    """Submission sequence number of the group."""
    sample_index: int
    """Index of this sample in its group, in [0, n)."""
    prefix_ids: Sequence[int] = ()
    """Continued partial rollout: response tokens generated so far (generate only the rest,
    i.e. reduce the max-new-tokens budget by len(prefix_ids))."""
    prefix_versions: VersionRuns = dataclasses.field(default_factory=VersionRuns)
    """Per-token versions of `prefix_ids`."""
    prefix_payloads: tuple[Mapping[str, Any], ...] = ()
    """Payloads returned for the earlier segments of this sample."""
    attempt: int = 0
    """How many times this sample was dispatched before (aborts, errors)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GenerationResult:
    """What `generate` returns: the NEW tokens of this call (not the prefix)."""

    output_ids: Sequence[int]
    """New response tokens."""
    token_versions: Sequence[int]
    """Policy version of each new token (same length as output_ids); a list or `VersionRuns`."""
    status: FinishStatus = FinishStatus.FINISHED
    """FINISHED, or ABORTED with partial tokens."""
    payload: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Opaque (log-probs, routed experts, reward, ...): stored untouched in the sample."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One finished response."""

    sample_index: int
    """Index in the group."""
    output_ids: Sequence[int]
    """Full response tokens (all segments concatenated)."""
    token_versions: VersionRuns
    """Per-token policy versions (several runs when the generation spanned weight updates)."""
    payloads: tuple[Mapping[str, Any], ...]
    """One payload per generate segment, in order (one unless the sample was continued)."""
    min_version: int
    """Oldest version that produced a token (the served version at dispatch if empty)."""
    attempts: int
    """Generate calls this sample took."""

    @property
    def payload(self) -> Mapping[str, Any]:
        """Payload of the last segment."""
        return self.payloads[-1]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """A completed group of n samples of one prompt."""

    seq: int
    """Submission sequence number (the FIFO order)."""
    prompt: Prompt
    """The prompt."""
    samples: tuple[Sample, ...]
    """The n samples, ordered by sample index."""
    min_version: int
    """j_min: the oldest version of any token of the group (staleness is k - j_min)."""
    max_version: int
    """Newest version of any token of the group."""
    admitted_version: int
    """Served version when the group was admitted."""
    completed_at: float
    """Loop time at completion."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    """What `get_batch` returns."""

    groups: tuple[Group, ...]
    """Consumed groups (fewer than asked only when `end_of_data`)."""
    dropped: int
    """Groups dropped as too stale (k - j_min > max_off_policy_steps) while filling it."""
    filtered: int
    """Groups rejected by the group filter since the previous batch."""
    current_version: int
    """The trainer version k the batch was taken at."""
    wait_s: float
    """Time `get_batch` waited."""
    end_of_data: bool = False
    """The source is exhausted and nothing else will complete."""

    def staleness(self) -> list[int]:
        """k - j_min of each group."""
        return [self.current_version - g.min_version for g in self.groups]

    def staleness_hist(self) -> list[int]:
        """Group counts by staleness: `out[i]` = groups with k - j_min = i (`[]` when empty).

        Example: staleness [0, 2, 2] gives [1, 0, 2].
        """
        stale = self.staleness()
        out = [0] * (max(stale) + 1) if stale else []
        for s in stale:
            out[s] += 1
        return out


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Accounting:
    """Group counts: `dispatched == consumed + dropped + filtered + pending` always holds."""

    dispatched: int
    """Groups admitted from the source."""
    consumed: int
    """Groups returned by `get_batch` (trained)."""
    dropped: int
    """Groups dropped as too stale."""
    filtered: int
    """Groups rejected by the group filter."""
    pending: int
    """Groups admitted and not yet consumed, dropped or filtered."""

    @property
    def balanced(self) -> bool:
        """True when no group is unaccounted for."""
        return self.dispatched == self.consumed + self.dropped + self.filtered + self.pending
