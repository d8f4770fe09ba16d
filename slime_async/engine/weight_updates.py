"""Weight updates of the embedded engine: SGLang's locking rule for them, the swap tail every
update path shares, and the updates that need no weight group (a checkpoint directory, a LoRA
adapter, a version label).

Owns: `UpdateResult` and `WeightUpdates` (one per `Engine`, `engine.weights`). Every update is
validated off the serving path, then swapped in between two decode steps (no forward in
flight), so a failed load never touches the weights being served. The lock rule (SGLang
0.5.x, `WeightUpdates.access`): every running `/generate` holds `Engine.model_lock` as a
reader; an update while generation is not paused takes it as the writer, so it waits until
the running requests finished ("drain, then swap"); after `/pause_generation` the update runs
at once, and with `flush_cache: true` (the default) it fails while requests are still in the
engine (paused in place, or retracted). The swap tail (`WeightUpdates.swap`), written once:
the change runs in the model thread as a new weights epoch (no prefix cached under the old
weights is reused), then the prefix cache is flushed if asked and the version label moves.
Updates over a weight-update group live in `engine/weight_receive.py` and use both. Must never
import aiohttp (the server wraps this class).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from slime_async.engine.config import EngineConfig
from slime_async.engine.disk_weights import read_weights_from_disk
from slime_async.engine.model import LoadedModel, swap_weights
from slime_async.engine.rwlock import RWLock
from slime_async.engine.scheduler import Scheduler


class ServingEngine(Protocol):
    """What the updates need of the `Engine` they update (it owns them; this module never
    imports it)."""

    cfg: EngineConfig
    lm: LoadedModel | None
    scheduler: Scheduler | None
    model_lock: RWLock
    paused: bool
    weight_version: str

    def requests_in_engine(self) -> int: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UpdateResult:
    """Outcome of a weight or version update (SGLang `{success, message}`)."""

    success: bool
    message: str
    num_paused_requests: int = 0
    received: bool | None = None
    """`update_weights_from_distributed` only: whether the bucket was received (a refusal
    without it leaves this engine out of step with its group: the sender must abort it)."""
    group_broken: bool = False
    """`update_weights_from_distributed` only: the receive had started and failed because the
    group broke under it (rank 0 or another member failed): this engine was in step and is
    not the cause, so the sender does not leave it out of the resend."""


class WeightUpdates:
    """The weight and version updates of one `Engine` (after `engine.start()`)."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()
        """One update at a time (the version-only update included)."""

    @property
    def lock(self) -> asyncio.Lock:
        """The one-update-at-a-time lock (a sleep or wake takes it too: `engine/sleep.py`)."""
        return self._lock

    # ------------------------------------------------------------------ the rule and the tail
    @contextlib.asynccontextmanager
    async def access(self, *, abort_all_requests: bool, what: str) -> AsyncIterator[None]:
        """SGLang's rule for every weight update: abort first if asked; then, unless generation
        is paused, wait for the writer side of `model_lock` (every running request finishes)."""
        eng = self.engine
        assert eng.scheduler is not None
        if abort_all_requests:
            eng.scheduler.abort(abort_all=True, message=f"Abort by {what}")
        async with self._lock:
            if eng.paused:
                yield
            else:
                async with eng.model_lock.writer():
                    yield

    def flush_refusal(self, what: str) -> UpdateResult | None:
        """The answer to an update with `flush_cache: true` while requests are in the engine
        (None when there are none)."""
        n = self.engine.requests_in_engine()
        if n == 0:
            return None
        return UpdateResult(
            success=False,
            message=(
                f"{what} with flush_cache=true cannot flush the cache: {n} requests are in the "
                "engine (paused in place or retracted). Pass flush_cache: false to keep them "
                "(pause_generation mode in_place -> update -> continue_generation), or pause "
                "with mode abort first. The served weights are unchanged."
            ),
        )

    async def swap(
        self, change: Callable[[], object], *, flush_cache: bool, weight_version: str | None
    ) -> int:
        """The swap tail of every update path: `change` runs in the model thread between two
        decode steps and starts a new weights epoch (`Scheduler.swap_weights`); then the prefix
        cache is dropped if `flush_cache`, and the served version becomes `weight_version`
        when one is given. Returns the requests in the engine at the swap (SGLang's
        `num_paused_requests`). If `change` raises, nothing after it happens."""
        eng = self.engine
        assert eng.scheduler is not None
        in_flight = eng.requests_in_engine()
        await eng.scheduler.swap_weights(change)
        if flush_cache:
            eng.scheduler.flush_cache()
        if weight_version is not None:
            self.set_version(weight_version)
        return in_flight

    def set_version(self, version: str) -> None:
        """Label what is served `version` (new tokens of every held request carry it)."""
        eng = self.engine
        eng.weight_version = version
        assert eng.scheduler is not None
        eng.scheduler.note_version(version)

    # ------------------------------------------------------------------ checkpoint directory
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        abort_all_requests: bool,
        flush_cache: bool = True,
    ) -> UpdateResult:
        """Under SGLang's lock rule (`access`): load and validate, swap between two steps. On
        any failure the old weights keep serving. Loading runs in the model thread:
        `from_pretrained` flips process-wide torch defaults (default dtype, init patches) that
        must never overlap a forward."""
        lm = self.engine.lm
        assert lm is not None

        def load_and_swap() -> None:
            swap_weights(lm, read_weights_from_disk(lm, model_path))

        what = "update_weights_from_disk"
        async with self.access(abort_all_requests=abort_all_requests, what=what):
            t0 = time.monotonic()
            if flush_cache and (refused := self.flush_refusal(what)) is not None:
                return refused
            try:
                in_flight = await self.swap(
                    load_and_swap, flush_cache=flush_cache, weight_version=weight_version
                )
            except ValueError as e:
                return UpdateResult(success=False, message=f"Failed to update weights: {e}")
            return UpdateResult(
                success=True,
                message=(
                    f"Succeeded to update model weights from {model_path} in "
                    f"{time.monotonic() - t0:.3f}s."
                ),
                num_paused_requests=in_flight,
            )

    # ------------------------------------------------------------------ version label
    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool
    ) -> UpdateResult:
        """`/update_weight_version`: the label alone (no weights change, no new epoch)."""
        assert self.engine.scheduler is not None
        async with self._lock:
            if abort_all_requests:
                self.engine.scheduler.abort(
                    abort_all=True, message="Abort by update_weight_version"
                )
            self.set_version(new_version)
        return UpdateResult(success=True, message=f"Weight version updated to {new_version}")

    # ------------------------------------------------------------------ LoRA adapters
    async def load_lora_adapter(
        self,
        name: str,
        path: str | None,
        *,
        weight_version: str | None = None,
        from_distributed: bool = False,
    ) -> UpdateResult:
        """SGLang's `/load_lora_adapter`: stage (read and check) `path`, then serve it as
        `name`. With `weight_version` an adapter of that name is replaced in place (a versioned
        push: under SGLang's lock rule like a weight update, in-flight requests continue under
        the new adapter and their tokens carry the new version). `from_distributed` (our
        extension, no `path`): activate the adapter `name` received over a weight group with
        exactly this `weight_version`. Any failure leaves what was served unchanged."""
        assert self.engine.lm is not None
        lora = self.engine.lm.lora
        if lora is None:
            return UpdateResult(
                success=False, message="this engine serves no LoRA: start it with --enable-lora"
            )
        if from_distributed:
            adapter = lora.received.get(name)
            if adapter is None or weight_version is None or adapter.label != weight_version:
                have = "none" if adapter is None else f"version {adapter.label}"
                return UpdateResult(
                    success=False,
                    message=f"Failed to load LoRA adapter: no adapter {name!r} of version "
                    f"{weight_version} was received over a weight group (received: {have}); "
                    "push it with update_weights_from_distributed (lora_name set) first",
                )
            path = adapter.path
        else:
            assert path is not None
            try:
                adapter = await asyncio.to_thread(lora.stage, name, path)
            except (ValueError, OSError) as e:
                return UpdateResult(success=False, message=f"Failed to load LoRA adapter: {e}")
        replace = weight_version is not None
        async with self.access(abort_all_requests=False, what="load_lora_adapter"):
            try:  # a new cache epoch: no prefix computed under the old adapter is reused
                await self.swap(
                    lambda: lora.activate(adapter, replace=replace),
                    flush_cache=False,
                    weight_version=weight_version,
                )
            except ValueError as e:
                return UpdateResult(success=False, message=f"Failed to load LoRA adapter: {e}")
        return UpdateResult(success=True, message=f"Loaded LoRA adapter {name!r} from {path}")

    async def unload_lora_adapter(self, name: str) -> UpdateResult:
        """SGLang's `/unload_lora_adapter`; refused while a queued or running request names
        the adapter (it would lose the weights it is generating under)."""
        eng = self.engine
        assert eng.lm is not None and eng.scheduler is not None
        lora = eng.lm.lora
        if lora is None:
            return UpdateResult(success=False, message="this engine serves no LoRA adapters")
        users = [s for s in eng.scheduler.held() if s.lora == name]
        if users:
            return UpdateResult(
                success=False,
                message=(
                    f"adapter {name!r} serves {len(users)} requests in the engine; unload it "
                    "once they finished (or abort them first)"
                ),
            )
        try:
            await self.swap(lambda: lora.unload(name), flush_cache=False, weight_version=None)
        except ValueError as e:
            return UpdateResult(success=False, message=str(e))
        return UpdateResult(success=True, message=f"Unloaded LoRA adapter {name!r}")
