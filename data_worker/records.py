"""Mutable bookkeeping records of the scheduling core (internal).

Owns the per-sample and per-group records (`SampleSlot`, `GroupRecord`), their lifecycle enums, the
`Dispatch` ticket handed to the asyncio shell, and `PROBE_PRIORITY`. Only `scheduler.py` and
`state.py` touch the records. Never imports `slime_async`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from data_worker.types import GenerationRequest, Group, Prompt, Sample
from data_worker.versions import VersionRuns

PROBE_PRIORITY = float(2**53)
"""`priority` passed to `generate` for probes and re-issued samples (larger = sooner)."""

EMPTY_RUNS = VersionRuns()

# Fast constructors for the two value types built once per sample on the hot path. A frozen
# dataclass __init__ goes through object.__setattr__ per field (~4x slower); these set the slot
# descriptors directly and give an identical object (tests/test_data_worker_units.py checks it).
_new = object.__new__
REQUEST_FIELDS = (
    "prompt",
    "group_seq",
    "sample_index",
    "prefix_ids",
    "prefix_versions",
    "prefix_payloads",
    "attempt",
)
SAMPLE_FIELDS = (
    "sample_index",
    "output_ids",
    "token_versions",
    "payloads",
    "min_version",
    "attempts",
)
GROUP_FIELDS = (
    "seq",
    "prompt",
    "samples",
    "min_version",
    "max_version",
    "admitted_version",
    "completed_at",
)
_rq = tuple(GenerationRequest.__dict__[n].__set__ for n in REQUEST_FIELDS)
_sm = tuple(Sample.__dict__[n].__set__ for n in SAMPLE_FIELDS)
_gr = tuple(Group.__dict__[n].__set__ for n in GROUP_FIELDS)


def make_request(
    prompt: Prompt,
    group_seq: int,
    sample_index: int,
    prefix_ids: Sequence[int],
    prefix_versions: VersionRuns,
    prefix_payloads: tuple[Mapping[str, Any], ...],
    attempt: int,
) -> GenerationRequest:
    """`GenerationRequest(...)` with every field given, built without the frozen-init cost."""
    r = _new(GenerationRequest)
    _rq[0](r, prompt)
    _rq[1](r, group_seq)
    _rq[2](r, sample_index)
    _rq[3](r, prefix_ids)
    _rq[4](r, prefix_versions)
    _rq[5](r, prefix_payloads)
    _rq[6](r, attempt)
    return r


def make_sample(
    sample_index: int,
    output_ids: Sequence[int],
    token_versions: VersionRuns,
    payloads: tuple[Mapping[str, Any], ...],
    min_version: int,
    attempts: int,
) -> Sample:
    """`Sample(...)` with every field given, built without the frozen-init cost."""
    s = _new(Sample)
    _sm[0](s, sample_index)
    _sm[1](s, output_ids)
    _sm[2](s, token_versions)
    _sm[3](s, payloads)
    _sm[4](s, min_version)
    _sm[5](s, attempts)
    return s


def make_group(
    seq: int,
    prompt: Prompt,
    samples: tuple[Sample, ...],
    min_version: int,
    max_version: int,
    admitted_version: int,
    completed_at: float,
) -> Group:
    """`Group(...)` with every field given, built without the frozen-init cost."""
    g = _new(Group)
    _gr[0](g, seq)
    _gr[1](g, prompt)
    _gr[2](g, samples)
    _gr[3](g, min_version)
    _gr[4](g, max_version)
    _gr[5](g, admitted_version)
    _gr[6](g, completed_at)
    return g


def newest_version(sample: Sample) -> int:
    """Newest version among a sample's tokens (its dispatch version when it has none)."""
    newest = sample.token_versions.max()
    return sample.min_version if newest is None else newest


class SampleState(Enum):
    """Where one sample of a group is."""

    WAITING_PROBE = "waiting_probe"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class GroupState(Enum):
    """Where one group is."""

    GENERATING = "generating"
    COMPLETE = "complete"
    STAGED = "staged"
    CONSUMED = "consumed"
    DROPPED = "dropped"
    FILTERED = "filtered"


class SampleSlot:
    """One sample of a group while it is generated (mutable; internal)."""

    __slots__ = (
        "attempts",
        "enqueued_at",
        "first_version",
        "gen",
        "index",
        "payloads",
        "prefix_ids",
        "rec",
        "sample",
        "state",
        "versions",
    )

    def __init__(self, rec: GroupRecord, index: int) -> None:
        self.rec = rec
        self.index = index
        self.state = SampleState.WAITING_PROBE
        self.attempts = 0
        self.enqueued_at = 0.0
        self.gen = 0
        self.first_version: int | None = None
        self.prefix_ids: Sequence[int] = ()
        self.versions = EMPTY_RUNS
        self.payloads: tuple[Mapping[str, Any], ...] = ()
        self.sample: Sample | None = None


class GroupRecord:
    """One admitted group and its n sample slots (mutable; internal)."""

    __slots__ = (
        "admitted_version",
        "group",
        "next_wait",
        "probing",
        "prompt",
        "remaining",
        "seq",
        "slots",
        "state",
    )

    def __init__(self, seq: int, prompt: Prompt, n: int, version: int) -> None:
        self.seq = seq
        self.prompt = prompt
        self.slots = [SampleSlot(self, i) for i in range(n)]
        self.state = GroupState.GENERATING
        self.probing = False
        self.next_wait = n
        self.remaining = n
        self.admitted_version = version
        self.group: Group | None = None


class Dispatch:
    """One generate call to make: `generate(request, priority, expected_len)`."""

    __slots__ = ("attempt", "expected_len", "priority", "request", "settled", "slot")

    def __init__(
        self, slot: SampleSlot, request: GenerationRequest, priority: float, expected_len: int
    ) -> None:
        self.slot = slot
        self.request = request
        self.priority = priority
        self.expected_len = expected_len
        self.attempt = request.attempt
        self.settled = False
