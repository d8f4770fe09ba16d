"""RolloutDataWorker: the asyncio shell around the scheduling core.

Owns the worker lifecycle (`WorkerState`), the generate tasks, pause/resume around weight
updates, `get_batch`, metrics and checkpoint state. Every scheduling decision lives in
`data_worker.scheduler.SchedulerCore`; this module only turns them into tasks and events.
No Ray inside (the orchestrator wraps it in an actor); never imports `slime_async`.
See the package docstring (`data_worker/__init__.py`) for the integration contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable, Mapping
from enum import Enum
from typing import Any

from data_worker.budget import batch_reachable
from data_worker.config import DataWorkerConfig
from data_worker.scheduler import Dispatch, SchedulerCore
from data_worker.source import PromptSource
from data_worker.state import core_load_state_dict, core_state_dict
from data_worker.types import Accounting, Batch, GenerationRequest, GenerationResult, Group

GenerateFn = Callable[[GenerationRequest, float, int], Awaitable[GenerationResult]]
"""`async generate(request, priority, expected_len) -> GenerationResult`."""
AbortFn = Callable[[], Awaitable[None]]
"""`async abort_all()`: make every running generate call return ABORTED soon."""
GroupFilter = Callable[[Group], bool]
"""`keep = group_filter(group)`; rejected groups are counted and replaced by fresh prompts."""


class WorkerState(Enum):
    """Lifecycle: CREATED -> RUNNING <-> PAUSED -> STOPPED (or FAILED on an error)."""

    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"
    FAILED = "failed"


class RolloutDataWorker:
    """Windowed-FIFO, length-probe, staleness-budgeted producer of prompt groups."""

    def __init__(
        self,
        cfg: DataWorkerConfig,
        source: PromptSource,
        generate: GenerateFn,
        group_filter: GroupFilter | None = None,
        *,
        abort_fn: AbortFn | None = None,
    ) -> None:
        if not isinstance(cfg, DataWorkerConfig):
            raise TypeError(f"cfg must be a DataWorkerConfig, got {type(cfg).__name__}.")
        if not isinstance(source, PromptSource):
            raise TypeError(
                "source must implement PromptSource (next_prompt, state_dict, load_state_dict); "
                "wrap a list of prompts in InMemoryPromptSource."
            )
        if not callable(generate):
            raise TypeError("generate must be an async callable (request, priority, expected_len).")
        self.cfg = cfg
        self._generate = generate
        self._abort_fn = abort_fn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core = SchedulerCore(cfg, source, clock=self._now, group_filter=group_filter)
        self._state = WorkerState.CREATED
        self._tasks: dict[Dispatch, asyncio.Task[None]] = {}  # running generate calls
        self._progress = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._failure: BaseException | None = None
        self._dropped_mark = 0
        self._filtered_mark = 0
        self._last: dict[str, Any] = {
            "staleness/mean": 0.0,
            "staleness/max": 0.0,
            "staleness/hist": [],
            "staleness/dropped": 0.0,
            "timing/dispatch_wait": 0.0,
            "timing/trainer_wait": 0.0,
        }

    # ------------------------------------------------------------------ lifecycle
    @property
    def state(self) -> WorkerState:
        """Current lifecycle state."""
        return self._state

    @property
    def served_version(self) -> int:
        """Version the engines serve (as last told by `set_served_version`)."""
        return self._core.served_version

    def oldest_unfinished_version(self) -> int:
        """The oldest version a token of any sample not yet finished can carry
        (`SchedulerCore.oldest_unfinished_version`): per-version state older than it is no
        longer needed for the samples still to come."""
        return self._core.oldest_unfinished_version()

    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else 0.0

    async def start(self) -> None:
        """Begin admitting prompts and dispatching generations."""
        if self._state is not WorkerState.CREATED:
            raise RuntimeError(f"start() called on a {self._state.value} worker; create a new one.")
        self._loop = asyncio.get_running_loop()
        self._core.clock = self._loop.time
        self._state = WorkerState.RUNNING
        self._pump()

    async def stop(self, *, drain: bool = False) -> None:
        """Stop: with `drain`, let running generations finish; otherwise cancel them.

        Cancelled samples go back to the queue, so `state_dict()` after `stop()` still holds
        every pending group.
        """
        if self._state in (WorkerState.STOPPED, WorkerState.CREATED):
            self._state = WorkerState.STOPPED
            return
        if drain and self._state is not WorkerState.FAILED:
            self._state = WorkerState.PAUSED
            await self._idle.wait()
        self._state = WorkerState.STOPPED
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for d in list(self._tasks):  # cancelled before or while awaiting generate: re-queue
            if not d.settled:
                self._core.on_lost(d, error=None)
        self._tasks.clear()
        self._idle.set()
        self._progress.set()

    def set_served_version(self, version: int) -> None:
        """Engines now serve `version`: the admission budget re-opens accordingly."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {version!r}.")
        if version < self._core.served_version:
            raise ValueError(
                f"served version went backwards ({self._core.served_version} -> {version}); "
                "versions are the trainer's optimizer-step count and only grow."
            )
        self._core.served_version = version
        self._pump()

    async def pause(self, *, timeout: float | None = None) -> None:
        """Stop dispatching and wait until no generation runs (call before a weight update).

        With an `abort_fn`, it is awaited first so running generations return ABORTED at once;
        their samples are then continued or re-issued per `cfg.partial_rollout`. Without one,
        pause waits for running generations to finish.
        """
        if self._state is WorkerState.PAUSED:
            return
        self._require(WorkerState.RUNNING, "pause()")
        self._state = WorkerState.PAUSED
        if self._abort_fn is not None and self._core.running:
            await self._abort_fn()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise TimeoutError(
                f"pause(): {self._core.running} generations still running after {timeout}s; "
                "generate must return ABORTED promptly when abort_fn is called."
            ) from None

    @property
    def paused(self) -> bool:
        """Between `pause()` and `resume()`."""
        return self._state is WorkerState.PAUSED

    async def resume(self) -> None:
        """Resume dispatching after `pause()` (aborted samples go first)."""
        if self._state is WorkerState.RUNNING:
            return
        self._require(WorkerState.PAUSED, "resume()")
        self._state = WorkerState.RUNNING
        self._pump()

    def _require(self, state: WorkerState, what: str) -> None:
        if self._failure is not None:
            raise RuntimeError(f"data worker failed: {self._failure}") from self._failure
        if self._state is not state:
            raise RuntimeError(
                f"{what} needs a {state.value} worker, this one is {self._state.value}."
            )

    # ------------------------------------------------------------------ dispatch
    def _pump(self) -> None:
        if self._state is not WorkerState.RUNNING and self._state is not WorkerState.PAUSED:
            return
        core = self._core
        limit = self.cfg.max_inflight
        while True:
            while core.admit_one():
                pass
            if self._state is not WorkerState.RUNNING or core.running >= limit:
                return
            d = core.next_dispatch()
            if d is None:
                return
            self._idle.clear()
            task = self._loop.create_task(self._run(d))  # type: ignore[union-attr]
            self._tasks[d] = task

    async def _run(self, d: Dispatch) -> None:
        core = self._core
        try:
            result = await self._generate(d.request, d.priority, d.expected_len)
        except Exception as exc:
            if not core.on_lost(d, error=exc):
                key = d.request.prompt.key
                self._fail(
                    RuntimeError(
                        f"generate raised {d.slot.attempts} times for prompt {key!r} "
                        f"(max_generate_retries={self.cfg.max_generate_retries}): {exc!r}"
                    )
                )
        else:
            try:
                if core.on_result(d, result):
                    self._progress.set()
            except Exception as exc:
                self._fail(exc)
        # not reached when cancelled: stop() re-queues those
        del self._tasks[d]
        self._after()

    def _after(self) -> None:
        if self._core.running == 0:
            self._idle.set()
        if self._state is WorkerState.RUNNING:
            self._pump()

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._state = WorkerState.FAILED
        self._progress.set()

    # ------------------------------------------------------------------ consumption
    async def get_batch(
        self, num_groups: int, current_version: int, timeout: float | None = None
    ) -> Batch:
        """The next `num_groups` eligible groups for train step `current_version`.

        Groups with `current_version - j_min > max_off_policy_steps` are dropped (counted in
        `Batch.dropped`). Returns fewer groups, with `end_of_data`, once the source is exhausted
        and nothing else can complete. Raises TimeoutError after `timeout` seconds (groups
        already taken are kept for the next call).
        """
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(f"num_groups must be an integer >= 1, got {num_groups!r}.")
        if self._state is WorkerState.CREATED:
            raise RuntimeError("get_batch() before start(): await worker.start() first.")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = math.inf if timeout is None else t0 + timeout
        core = self._core
        while True:
            if self._failure is not None:
                raise RuntimeError(f"data worker failed: {self._failure}") from self._failure
            groups = core.take(num_groups, current_version)
            self._pump()  # drops refund the budget
            end = False
            if groups is None and core.drained():
                groups, end = core.consume_staged(num_groups), True
            if groups is not None:
                return self._make_batch(groups, current_version, loop.time() - t0, end)
            if self._state is WorkerState.STOPPED:
                raise RuntimeError("get_batch() on a stopped worker.")
            s = self.cfg.max_staleness
            reachable = batch_reachable(
                current_version=current_version,
                served_version=core.served_version,
                max_staleness=s,
                groups_per_step=self.cfg.groups_per_step,
            )
            if core.budget_blocked() and not reachable:
                raise RuntimeError(
                    f"get_batch(current_version={current_version}) can never be filled: the "
                    f"engines serve version {core.served_version} and max_staleness={s}, so "
                    "the budget admits no new prompt. Push weights and call "
                    "set_served_version() before waiting for the next batch."
                )
            remaining = deadline - loop.time()
            if remaining <= 1e-9:  # not 0: float rounding must not spin the loop
                raise TimeoutError(
                    f"get_batch: {core.num_eligible()} of {num_groups} groups ready after "
                    f"{timeout}s ({core.running} generations running, {core.queued} queued)."
                )
            self._progress.clear()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._progress.wait(), None if math.isinf(remaining) else remaining
                )

    def _make_batch(self, groups: list[Group], version: int, wait: float, end: bool) -> Batch:
        core = self._core
        batch = Batch(
            groups=tuple(groups),
            dropped=core.n_dropped - self._dropped_mark,
            filtered=core.n_filtered - self._filtered_mark,
            current_version=version,
            wait_s=wait,
            end_of_data=end,
        )
        self._dropped_mark, self._filtered_mark = core.n_dropped, core.n_filtered
        stale = batch.staleness()
        self._last = {
            "staleness/mean": sum(stale) / len(stale) if stale else 0.0,
            "staleness/max": float(max(stale, default=0)),
            "staleness/hist": batch.staleness_hist(),
            "staleness/dropped": float(batch.dropped),
            "timing/dispatch_wait": core.wait_sum / core.wait_count if core.wait_count else 0.0,
            "timing/trainer_wait": wait,
        }
        core.wait_sum, core.wait_count = 0.0, 0
        return batch

    # ------------------------------------------------------------------ introspection
    def accounting(self) -> Accounting:
        """Group counts; `dispatched == consumed + dropped + filtered + pending` always."""
        return self._core.accounting()

    def metrics(self) -> dict[str, Any]:
        """Gauges, counters (`data/*`, cumulative), and the stats of the last returned batch
        (`staleness/*`: mean, max, count histogram and groups dropped while filling it)."""
        core = self._core
        decided = core.n_probes + core.n_cache_hits
        acc = core.accounting()
        return {
            "data/queue_depth": float(core.queued),
            "data/waiting_probe": float(core.waiting),
            "data/inflight": float(core.running),
            "data/eligible_groups": float(core.num_eligible()),
            "data/blocked_groups": float(core.num_blocked()),
            "data/head_lag": float(core.next_seq - core.window.head),
            "data/live_groups": float(core.live()),
            "data/admission_limit": float(core.limit()),
            "data/served_version": float(core.served_version),
            "data/probe_hit_rate": core.n_cache_hits / decided if decided else 0.0,
            "data/length_cache_size": float(len(core.cache)),
            "data/dispatched_groups": float(acc.dispatched),
            "data/consumed_groups": float(acc.consumed),
            "data/filtered_groups": float(acc.filtered),
            "data/pending_groups": float(acc.pending),
            "data/generate_calls": float(core.n_dispatches),
            "data/aborted": float(core.n_aborted),
            "data/generate_errors": float(core.n_errors),
            "data/dropped_groups": float(acc.dropped),
            **length_fairness(core),
            **self._last,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable checkpoint (no pickle); running work is saved as prompts."""
        return core_state_dict(self._core)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`; only on a fresh worker, before `start()`."""
        if self._state is not WorkerState.CREATED:
            raise RuntimeError("load_state_dict() must be called before start().")
        core_load_state_dict(self._core, state)


def length_fairness(core: SchedulerCore) -> dict[str, float]:
    """Cumulative response lengths of the groups trained and of those dropped as too stale
    (`length/*`): `length/trained_bias` = trained mean / completed mean − 1, where completed =
    trained + dropped. Dropping stale groups drops the slow ones, which are the long ones, so
    a negative bias means the staleness drop trains shorter responses than the engines wrote."""
    ct, cs = core.consumed_tokens, core.consumed_samples
    dt, ds = core.dropped_tokens, core.dropped_samples
    trained = ct / cs if cs else 0.0
    completed = (ct + dt) / (cs + ds) if cs + ds else 0.0
    return {
        "length/trained_mean": trained,
        "length/dropped_mean": dt / ds if ds else 0.0,
        "length/completed_mean": completed,
        "length/trained_bias": trained / completed - 1.0 if completed else 0.0,
    }
