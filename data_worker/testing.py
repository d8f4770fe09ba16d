"""A simulated generation engine for tests and demos of the RolloutDataWorker.

Owns `SimulatedEngine`: an async `generate` that emits tokens in chunks on `asyncio.sleep`
(time proportional to response length), tags every token with the version the engine serves
when it is produced (so a generation that spans a weight update gets several versions),
honours `abort_all()` by returning ABORTED with the partial tokens, and records every call.
Token ids are deterministic (`1000 * sample_index + position`), so a continued generation must
reproduce exactly the tokens of an uninterrupted one. Never imports `slime_async`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from data_worker.types import FinishStatus, GenerationRequest, GenerationResult, Prompt


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CallRecord:
    """One generate call as the engine saw it."""

    group_seq: int
    key: str
    sample_index: int
    priority: float
    expected_len: int
    attempt: int
    prefix_len: int
    start: float


class SimulatedEngine:
    """Chunked token generator on the event loop's clock (real or virtual)."""

    def __init__(
        self,
        *,
        length_fn: Callable[[Prompt, int], int],
        token_time: float = 1e-3,
        chunk: int = 1,
        fail_fn: Callable[[GenerationRequest], bool] | None = None,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}.")
        self.length_fn = length_fn
        self.token_time = token_time
        self.chunk = chunk
        self.fail_fn = fail_fn
        self.version = 0
        self.calls: list[CallRecord] = []
        self.active = 0
        self.max_active = 0
        self._abort_epoch = 0

    def set_version(self, version: int) -> None:
        """Tokens produced from now on carry `version`."""
        self.version = version

    async def abort_all(self) -> None:
        """Make every running generate call return ABORTED at its next chunk boundary."""
        self._abort_epoch += 1

    async def generate(
        self, request: GenerationRequest, priority: float, expected_len: int
    ) -> GenerationResult:
        """Produce the rest of the response (total length from `length_fn`)."""
        loop = asyncio.get_running_loop()
        self.calls.append(
            CallRecord(
                group_seq=request.group_seq,
                key=request.prompt.key,
                sample_index=request.sample_index,
                priority=priority,
                expected_len=expected_len,
                attempt=request.attempt,
                prefix_len=len(request.prefix_ids),
                start=loop.time(),
            )
        )
        if self.fail_fn is not None and self.fail_fn(request):
            raise RuntimeError("simulated engine failure")
        epoch = self._abort_epoch
        total = self.length_fn(request.prompt, request.sample_index)
        pos = len(request.prefix_ids)
        ids: list[int] = []
        versions: list[int] = []
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            while pos < total:
                if self._abort_epoch != epoch:
                    return GenerationResult(
                        output_ids=ids,
                        token_versions=versions,
                        status=FinishStatus.ABORTED,
                        payload={"tokens": len(ids)},
                    )
                step = min(self.chunk, total - pos)
                await asyncio.sleep(step * self.token_time)
                base = 1000 * request.sample_index
                ids.extend(range(base + pos, base + pos + step))
                versions.extend([self.version] * step)
                pos += step
        finally:
            self.active -= 1
        return GenerationResult(
            output_ids=ids, token_versions=versions, payload={"tokens": len(ids)}
        )
