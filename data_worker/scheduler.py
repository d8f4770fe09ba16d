"""Synchronous scheduling core of the RolloutDataWorker (no asyncio, no I/O).

One responsibility, every scheduling decision (one class, `SchedulerCore`): admission under the
staleness budget, the dispatch queue (probe / longest-first / FIFO tiers), the per-prompt length
cache, the windowed-FIFO drain and off-policy drops, and the group accounting.
`RolloutDataWorker` drives it from asyncio; the simulator and the benchmark drive the same
object. Never imports `slime_async`.

Lifecycle of a sample: WAITING_PROBE -> QUEUED -> RUNNING -> DONE (an abort or an error sends
RUNNING back to QUEUED). Lifecycle of a group: GENERATING -> COMPLETE -> STAGED -> CONSUMED,
or -> DROPPED (too stale) / FILTERED (rejected by the group filter).

Dispatch order is a heap on `(tier, bucket, -expected_work, seq, index)` (expected work: the
cached response length, or the default, plus the prompt's `extra_work`, e.g. image tokens): tier 0 = re-issued
or continued samples, tier 1 = probes, tier 2 = everything else; `bucket = seq // bucket_groups`
keeps longest-first inside a bucket of consecutive groups so old short groups cannot starve.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from data_worker.budget import admission_limit
from data_worker.config import DataWorkerConfig, PartialRolloutPolicy, ProbeSiblings
from data_worker.length_cache import LengthCache
from data_worker.records import (
    EMPTY_RUNS,
    PROBE_PRIORITY,
    Dispatch,
    GroupRecord,
    GroupState,
    SampleSlot,
    SampleState,
    make_group,
    make_request,
    make_sample,
    newest_version,
)
from data_worker.source import PromptSource
from data_worker.types import (
    Accounting,
    FinishStatus,
    GenerationResult,
    Group,
)
from data_worker.versions import VersionRuns
from data_worker.window import FifoWindow


class SchedulerCore:
    """All scheduling state and rules; see the module docstring and docs/length-probe-dispatch.md."""

    def __init__(
        self,
        cfg: DataWorkerConfig,
        source: PromptSource,
        *,
        clock: Callable[[], float],
        group_filter: Callable[[Group], bool] | None = None,
    ) -> None:
        self.cfg = cfg
        self.source = source
        self.clock = clock
        self.group_filter = group_filter
        self.cache = LengthCache(alpha=cfg.length_ema_alpha)
        self._served_version = 0
        self._limit = self._compute_limit()
        self.groups: dict[int, GroupRecord] = {}  # every unresolved group (incl. staged)
        self.next_seq = 0
        self.window = FifoWindow(window=cfg.fifo_window)
        self._heap: list[tuple] = []
        self._waiters: deque[GroupRecord] = deque()
        self.staged: list[GroupRecord] = []
        self.exhausted = False
        self.queued = 0
        self.waiting = 0
        self.running = 0
        self.n_admitted = self.n_consumed = self.n_dropped = self.n_filtered = 0
        self.n_dispatches = self.n_aborted = self.n_errors = 0
        self.n_probes = self.n_cache_hits = 0
        # response tokens and samples of the groups consumed (trained) and dropped as too stale:
        # the length bias of the staleness drop (dropping stale groups starves long responses)
        self.consumed_tokens = self.consumed_samples = 0
        self.dropped_tokens = self.dropped_samples = 0
        self.wait_sum = 0.0
        self.wait_count = 0
        self._bucket = cfg.bucket_groups
        self._n = cfg.n_samples_per_prompt
        self._queued_limit = cfg.queued_limit
        self._siblings = cfg.probe_siblings
        self._default_len = float(cfg.default_expected_len)

    # ---------------------------------------------------------------- admission
    def live(self) -> int:
        """Admitted groups that count against the budget (dropped/filtered are refunded)."""
        return self.n_admitted - self.n_dropped - self.n_filtered

    @property
    def served_version(self) -> int:
        """Version the engines serve."""
        return self._served_version

    @served_version.setter
    def served_version(self, version: int) -> None:
        self._served_version = version
        self._limit = self._compute_limit()

    def _compute_limit(self) -> int:
        c = self.cfg
        return admission_limit(
            max_staleness=c.max_staleness,
            served_version=self._served_version,
            groups_per_step=c.groups_per_step,
        )

    def limit(self) -> int:
        """Current admission limit (S + v + 1) * B."""
        return self._limit

    def can_admit(self) -> bool:
        """Budget open, queue below its limit, source not exhausted."""
        return not self.exhausted and self.live() < self._limit and self.queued < self._queued_limit

    def admit_one(self) -> bool:
        """Pull one prompt and queue its group; False when the budget or the source says no."""
        if not self.can_admit():
            return False
        prompt = self.source.next_prompt()
        if prompt is None:
            self.exhausted = True
            return False
        rec = GroupRecord(self.next_seq, prompt, self._n, self.served_version)
        self.next_seq += 1
        self.n_admitted += 1
        self.groups[rec.seq] = rec
        self._schedule_new(rec)
        return True

    def _schedule_new(self, rec: GroupRecord) -> None:
        extra = rec.prompt.extra_work
        expected = self.cache.get(rec.prompt.key)
        expected = None if expected is None else expected + extra
        if not self.cfg.length_probe:
            for slot in rec.slots:
                self._push(slot, 2, 0.0)
        elif expected is None:
            self.n_probes += 1
            rec.probing = True
            self._push(rec.slots[0], 1, 0.0)
            if self._siblings is ProbeSiblings.QUEUE:
                for slot in rec.slots[1:]:
                    self._push(slot, 2, self._default_len + extra)
            else:
                rec.next_wait = 1
                self.waiting += self._n - 1
                if self._n > 1:
                    self._waiters.append(rec)
        else:
            self.n_cache_hits += 1
            for slot in rec.slots:
                self._push(slot, 2, expected)

    def _push(self, slot: SampleSlot, tier: int, expected: float) -> None:
        seq = slot.rec.seq
        slot.state = SampleState.QUEUED
        slot.enqueued_at = self.clock()
        self.queued += 1
        key = (tier, seq // self._bucket, -expected, seq, slot.index, slot.gen, slot)
        heapq.heappush(self._heap, key)

    # ---------------------------------------------------------------- dispatch
    def next_dispatch(self) -> Dispatch | None:
        """The next sample to send, or None when nothing is dispatchable."""
        heap = self._heap
        while heap:  # skip entries superseded by a re-rank
            tier, _, neg, _, _, gen, slot = heapq.heappop(heap)
            if gen == slot.gen and slot.state is SampleState.QUEUED:
                break
        else:
            slot = None
        if slot is not None:
            self.queued -= 1
            self.wait_sum += self.clock() - slot.enqueued_at
            self.wait_count += 1
        elif self._siblings is ProbeSiblings.BACKFILL and self._next_waiter() is not None:
            rec = self._waiters[0]
            slot = rec.slots[rec.next_wait]
            rec.next_wait += 1
            if rec.next_wait >= self._n:
                self._waiters.popleft()
            self.waiting -= 1
            tier, neg = 2, 0.0
        else:
            return None
        rec = slot.rec
        slot.state = SampleState.RUNNING
        self.running += 1
        self.n_dispatches += 1
        if slot.first_version is None:
            slot.first_version = self.served_version
        known = self.cache.get(rec.prompt.key)
        expected = known if known is not None else float(self.cfg.default_expected_len)
        # the response still to come, plus the prompt's fixed work (its image tokens)
        expected_len = max(1, round(expected) - len(slot.prefix_ids)) + rec.prompt.extra_work
        if tier < 2:
            priority = PROBE_PRIORITY
        else:
            priority = -neg if self.cfg.length_probe else 0.0
        request = make_request(
            rec.prompt,
            rec.seq,
            slot.index,
            slot.prefix_ids,
            slot.versions,
            slot.payloads,
            slot.attempts,
        )
        slot.attempts += 1
        return Dispatch(slot, request, priority, expected_len)

    def _check_ticket(self, d: Dispatch) -> SampleSlot:
        slot = d.slot
        if d.settled or slot.state is not SampleState.RUNNING or slot.attempts != d.attempt + 1:
            raise RuntimeError(
                f"result for group {d.request.group_seq} sample {d.request.sample_index} "
                "does not match a running dispatch (answered twice, or after load_state_dict)."
            )
        d.settled = True
        return slot

    def on_result(self, d: Dispatch, result: GenerationResult) -> bool:
        """Record a generate answer; True when it finished a group (kept or filtered)."""
        slot = self._check_ticket(d)
        if not isinstance(result, GenerationResult):
            raise TypeError(
                f"generate must return a GenerationResult, got {type(result).__name__}."
            )
        if len(result.token_versions) != len(result.output_ids):
            raise ValueError(
                f"generate returned {len(result.output_ids)} tokens but "
                f"{len(result.token_versions)} token_versions; give one version per new token."
            )
        self.running -= 1
        versions = VersionRuns.from_sequence(result.token_versions)
        if result.status is FinishStatus.ABORTED:
            self.n_aborted += 1
            if self.cfg.partial_rollout is PartialRolloutPolicy.CONTINUE:
                slot.prefix_ids = [*slot.prefix_ids, *result.output_ids]
                slot.versions = slot.versions + versions
                slot.payloads = (*slot.payloads, result.payload)
            else:
                self._reset(slot)
            self._push(slot, 0, 0.0)
            return False
        if slot.prefix_ids:
            ids = [*slot.prefix_ids, *result.output_ids]
            versions = slot.versions + versions
        else:
            ids = result.output_ids
        oldest = versions.min()
        slot.sample = make_sample(
            slot.index,
            ids,
            versions,
            (*slot.payloads, result.payload),
            slot.first_version if oldest is None else oldest,
            slot.attempts,
        )
        slot.state = SampleState.DONE
        slot.prefix_ids, slot.payloads, slot.versions = (), (), EMPTY_RUNS
        rec = slot.rec
        expected = self.cache.update(rec.prompt.key, len(ids))
        if rec.probing:
            self._release_waiters(rec, expected + rec.prompt.extra_work)
        rec.remaining -= 1
        if rec.remaining == 0:
            return self._complete(rec)
        return False

    def on_lost(self, d: Dispatch, *, error: BaseException | None) -> bool:
        """A generate call raised (error) or was cancelled (None): re-queue the sample.

        Returns False when an error exhausted the sample's retries (the worker must fail).
        """
        slot = self._check_ticket(d)
        self.running -= 1
        ok = True
        if error is not None:
            self.n_errors += 1
            ok = slot.attempts <= self.cfg.max_generate_retries
        self._push(slot, 0, 0.0)
        return ok

    @staticmethod
    def _reset(slot: SampleSlot) -> None:
        slot.prefix_ids, slot.payloads, slot.versions = (), (), EMPTY_RUNS
        slot.first_version = None

    def _release_waiters(self, rec: GroupRecord, expected: float) -> None:
        rec.probing = False
        if self._siblings is ProbeSiblings.QUEUE:  # re-rank siblings never dispatched yet
            for slot in rec.slots:
                if slot.state is SampleState.QUEUED and slot.attempts == 0:
                    slot.gen += 1
                    key = (2, rec.seq // self._bucket, -expected, rec.seq, slot.index, slot.gen)
                    heapq.heappush(self._heap, (*key, slot))
            return
        for slot in rec.slots[rec.next_wait :]:
            self.waiting -= 1
            self._push(slot, 2, expected)
        rec.next_wait = self._n  # its entry in _waiters is skipped lazily

    def _next_waiter(self) -> GroupRecord | None:
        waiters = self._waiters
        while waiters and not waiters[0].probing:
            waiters.popleft()
        return waiters[0] if waiters else None

    # ---------------------------------------------------------------- window
    def _complete(self, rec: GroupRecord) -> bool:
        samples = tuple(s.sample for s in rec.slots)  # type: ignore[misc]
        group = make_group(
            rec.seq,
            rec.prompt,
            samples,
            min(s.min_version for s in samples),
            max(newest_version(s) for s in samples),
            rec.admitted_version,
            self.clock(),
        )
        for s in rec.slots:
            s.sample = None
        if self.group_filter is not None and not self.group_filter(group):
            rec.state = GroupState.FILTERED
            self.n_filtered += 1
            del self.groups[rec.seq]
            self.window.release(rec.seq)
            return True
        rec.group = group
        rec.state = GroupState.COMPLETE
        self.window.on_complete(rec.seq)
        return True

    def _too_stale(self, rec: GroupRecord, version: int) -> bool:
        m = self.cfg.max_off_policy_steps
        return m is not None and version - rec.group.min_version > m  # type: ignore[union-attr]

    def _drop(self, rec: GroupRecord, *, staged: bool) -> None:
        rec.state = GroupState.DROPPED
        self.n_dropped += 1
        tokens, samples = _response_size(rec.group)
        self.dropped_tokens += tokens
        self.dropped_samples += samples
        del self.groups[rec.seq]
        if not staged:
            self.window.release(rec.seq)

    def take(self, num: int, version: int) -> list[Group] | None:
        """Consume `num` eligible groups (in completion order), dropping stale ones.

        Groups taken while fewer than `num` are available stay staged (and keep the window
        moving) until the next call; returns None until `num` groups are staged.
        """
        if self.cfg.max_off_policy_steps is not None and self.staged:
            keep = []
            for rec in self.staged:
                if self._too_stale(rec, version):
                    self._drop(rec, staged=True)
                else:
                    keep.append(rec)
            self.staged = keep
        while len(self.staged) < num:
            seq = self.window.pop_eligible()
            if seq is None:
                break
            rec = self.groups[seq]
            if self._too_stale(rec, version):
                self._drop(rec, staged=False)
                continue
            rec.state = GroupState.STAGED
            self.staged.append(rec)
            self.window.release(seq)
        if len(self.staged) < num:
            return None
        return self.consume_staged(num)

    def consume_staged(self, num: int) -> list[Group]:
        """Hand out up to `num` staged groups as consumed."""
        out, self.staged = self.staged[:num], self.staged[num:]
        for rec in out:
            rec.state = GroupState.CONSUMED
            del self.groups[rec.seq]
            tokens, samples = _response_size(rec.group)
            self.consumed_tokens += tokens
            self.consumed_samples += samples
        self.n_consumed += len(out)
        return [rec.group for rec in out]  # type: ignore[misc]

    def oldest_unfinished_version(self) -> int:
        """The oldest weight version a token of a sample not yet finished can carry: a sample
        once dispatched, the version served at its first dispatch (every token it has or will
        have, a continued sample's kept ones included, is of that version or newer); any other
        sample, the served version (versions only grow). What a consumer keeping per-version
        state for samples as they finish (the forward-only role) must still hold."""
        oldest = self._served_version
        for rec in self.groups.values():
            if rec.state is not GroupState.GENERATING:
                continue
            for slot in rec.slots:
                if slot.state is not SampleState.DONE and slot.first_version is not None:
                    oldest = min(oldest, slot.first_version)
        return oldest

    def drained(self) -> bool:
        """Source exhausted and every unresolved group is staged: nothing more will come."""
        return self.exhausted and len(self.groups) == len(self.staged)

    def budget_blocked(self) -> bool:
        """Nothing runs, queues or waits, and the budget forbids admitting more."""
        return (
            not self.exhausted
            and self.live() >= self.limit()
            and self.running == 0
            and self.queued == 0
            and self.waiting == 0
        )

    def accounting(self) -> Accounting:
        """Group counts (see `Accounting`)."""
        return Accounting(
            dispatched=self.n_admitted,
            consumed=self.n_consumed,
            dropped=self.n_dropped,
            filtered=self.n_filtered,
            pending=len(self.groups),
        )

    def num_eligible(self) -> int:
        """Completed groups consumable now (inside the window, plus staged)."""
        return self.window.num_eligible + len(self.staged)

    def num_blocked(self) -> int:
        """Completed groups waiting for the window head to advance."""
        return self.window.num_blocked


def _response_size(group: Group | None) -> tuple[int, int]:
    """(response tokens, samples) of a completed group."""
    if group is None:
        return 0, 0
    return sum(len(s.output_ids) for s in group.samples), len(group.samples)
