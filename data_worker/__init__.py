"""RolloutDataWorker: windowed FIFO drain, length-probe dispatch, staleness budget.

A standalone asyncio component (no Ray inside; the orchestrator wraps it in an actor). It never
imports `slime_async`. The algorithm and the staleness bound are in `docs/staleness-budget.md`,
`docs/windowed-fifo.md` and `docs/length-probe-dispatch.md`.

Integration contract (what the controller calls)::

    worker = RolloutDataWorker(cfg: DataWorkerConfig, source: PromptSource,
                               generate: GenerateFn, group_filter: GroupFilter | None = None,
                               *, abort_fn: AbortFn | None = None)
    worker.load_state_dict(state)            # optional, before start(): exact resume
    await worker.start()
    batch = await worker.get_batch(num_groups, current_version, timeout=None)  # -> Batch
    await worker.pause(timeout=None)         # before a weight update
    ...push weights version v to the engines...
    worker.set_served_version(v)             # engines now serve v: budget re-opens
    await worker.resume()
    worker.metrics() -> dict[str, float]     # data/*, staleness/*, timing/*
    worker.oldest_unfinished_version() -> int # no token still to come is of an older version
    worker.accounting() -> Accounting        # dispatched == consumed + dropped + filtered + pending
    worker.state_dict() -> dict              # JSON only; in-flight work saved as prompts
    await worker.stop(drain=False)

* `generate(request: GenerationRequest, priority: float, expected_len: int) -> GenerationResult`
  is awaited once per sample (or per segment of a continued sample). `priority`: larger = more
  urgent (`PROBE_PRIORITY` for probes and re-issued samples, else the expected length, or 0.0
  with `length_probe=False`). `expected_len` is the EMA response length of the prompt (the
  default for unknown prompts), minus tokens already generated, plus the prompt's
  `extra_work` (its image tokens); send it to the router as `X-Expected-Tokens`. Return the NEW tokens, one policy version per token (ints, or
  `VersionRuns`), `FinishStatus.FINISHED` or `ABORTED`, and an opaque payload (log-probs,
  routed experts, reward, ...) stored untouched in `Sample.payloads`. A continued sample's
  request carries `prefix_ids`, `prefix_versions` and `prefix_payloads`: generate only the
  rest (reduce max-new-tokens by `len(prefix_ids)`). Exceptions are retried
  `max_generate_retries` times, then fail the worker (get_batch raises).
* `abort_fn()`: awaited by `pause()`; must make running generate calls return ABORTED (with
  the partial tokens) promptly, e.g. the router's `/abort_request` fan-out. Without it, pause
  waits for running generations to finish. Aborted samples are continued (`partial_rollout=
  "continue"`: tokens kept, per-token versions) or re-issued whole (`"requeue"`).
* Call `set_served_version(v)` after every weight push, before waiting for the next batch: the
  budget admits a group only while `live < (S + v + 1) * B` (see README), and get_batch raises
  if the engines lag the trainer by more than S versions with nothing left to generate.
* `state_dict()` may be taken at any time; a worker restored with `load_state_dict` re-issues
  every unresolved group with its original sequence number: no prompt lost, none duplicated.
"""

from __future__ import annotations

from data_worker.budget import (
    admission_limit,
    batch_reachable,
    snapshot_count,
    staleness_bound,
    window_slack_steps,
    worst_case_staleness,
)
from data_worker.config import DataWorkerConfig, PartialRolloutPolicy
from data_worker.length_cache import LengthCache
from data_worker.records import PROBE_PRIORITY
from data_worker.scheduler import SchedulerCore
from data_worker.source import InMemoryPromptSource, PromptSource
from data_worker.types import (
    Accounting,
    Batch,
    FinishStatus,
    GenerationRequest,
    GenerationResult,
    Group,
    Prompt,
    Sample,
)
from data_worker.versions import VersionRuns
from data_worker.window import FifoWindow
from data_worker.worker import AbortFn, GenerateFn, GroupFilter, RolloutDataWorker, WorkerState

__all__ = [
    "PROBE_PRIORITY",
    "AbortFn",
    "Accounting",
    "Batch",
    "DataWorkerConfig",
    "FifoWindow",
    "FinishStatus",
    "GenerateFn",
    "GenerationRequest",
    "GenerationResult",
    "Group",
    "GroupFilter",
    "InMemoryPromptSource",
    "LengthCache",
    "PartialRolloutPolicy",
    "Prompt",
    "PromptSource",
    "RolloutDataWorker",
    "Sample",
    "SchedulerCore",
    "VersionRuns",
    "WorkerState",
    "admission_limit",
    "batch_reachable",
    "snapshot_count",
    "staleness_bound",
    "window_slack_steps",
    "worst_case_staleness",
]
