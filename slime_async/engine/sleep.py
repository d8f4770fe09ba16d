"""Sleep and wake of the embedded engine: SGLang's `/release_memory_occupation` and
`/resume_memory_occupation` with their tags, as levels.

Owns: `MemoryOccupation` (one per `Engine`, `engine.memory`): which tags are released, the
weights' spill file, and the rules. The tags are SGLang's: `kv_cache` (level 1: the running
batch's KV cache and the prefix cache are dropped), `weights` (level 2, with `kv_cache`: the
model's parameters are freed too; they are first written to a spill file, the engine's own copy
of the version it serves, which wake reads back bit for bit), `cuda_graph` (accepted, nothing to
free on a CPU). No tags (or null) means all of them, as in SGLang. The locking rule is SGLang's:
a release needs an idle engine (no request queued, running or paused in it; SGLang asserts the
same), so the caller aborts first (`/abort_request {"abort_all": true}`), and it runs under the
weight-update lock, so it never overlaps an update. While anything is released the engine
refuses `/generate` (503, `/health_generate` too); while the weights are released it refuses
weight updates (wake first, then push). Must never import aiohttp.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from slime_async.host import trim_heap

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)
"""SGLang's memory tags (`GPU_MEMORY_ALL_TYPES`)."""


def tags_for_level(level: int) -> list[str]:
    """The tags a sleep level releases: 1 = the KV cache (and prefix cache), 2 = also the
    weights.

    >>> tags_for_level(1), tags_for_level(2)
    (['kv_cache'], ['kv_cache', 'weights'])
    """
    if level not in (1, 2):
        raise ValueError(
            f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level}"
        )
    return [KV_CACHE] if level == 1 else [KV_CACHE, WEIGHTS]


def level_of(released: set[str] | frozenset[str]) -> int:
    """0 awake, 1 KV cache released, 2 weights released.

    >>> level_of(set()), level_of({"kv_cache"}), level_of({"kv_cache", "weights"})
    (0, 1, 2)
    """
    return 2 if WEIGHTS in released else (1 if released - {CUDA_GRAPH} else 0)


def parse_tags(raw: Any) -> list[str]:
    """The body's `tags` (None or empty: all of them); ValueError names a bad one."""
    if raw is None or raw == []:
        return list(TAGS)
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise ValueError(f"tags must be a list of strings out of {list(TAGS)}, got {raw!r}")
    bad = [t for t in raw if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tag(s) {bad}: SGLang's tags are {list(TAGS)}")
    return list(dict.fromkeys(raw))


class SleepingEngine(Protocol):
    """What sleep needs of the `Engine` (it owns this object; this module never imports it)."""

    lm: Any
    scheduler: Any
    weights: Any

    def requests_in_engine(self) -> int: ...

    @property
    def model_lock(self) -> Any: ...


class MemoryOccupation:
    """The released tags of one engine and the release/resume operations."""

    def __init__(self, engine: SleepingEngine, *, spill_dir: str | None = None) -> None:
        self.engine = engine
        self.released: set[str] = set()
        self._spill_dir = spill_dir
        self._spill: Path | None = None
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.last: dict[str, float] = {}
        """Seconds and bytes of the last release / resume (reported in `/server_info`)."""

    @property
    def level(self) -> int:
        return level_of(self.released)

    @property
    def sleeping(self) -> bool:
        """True while generation is impossible (the KV cache or the weights are released)."""
        return self.level > 0

    def why_asleep(self) -> str:
        return (
            f"the engine's memory is released (tags {sorted(self.released)}, sleep level "
            f"{self.level}): call /resume_memory_occupation before generating"
        )

    def refuse_update(self, what: str) -> str | None:
        """The refusal of a weight update while the weights are released (None: allowed)."""
        if WEIGHTS not in self.released:
            return None
        return (
            f"{what}: the weights are released (release_memory_occupation); resume them "
            "(/resume_memory_occupation with tags ['weights']) before updating"
        )

    def info(self) -> dict[str, Any]:
        return {"released_tags": sorted(self.released), "sleep_level": self.level, **self.last}

    # ------------------------------------------------------------------ release / resume
    async def release(self, tags: list[str]) -> None:
        """SGLang's release: refused (ValueError) unless the engine is idle."""
        eng = self.engine
        async with eng.weights.lock:
            n = eng.requests_in_engine()
            if n or eng.model_lock.readers:
                raise ValueError(
                    "release_memory_occupation should be called only when no ongoing request: "
                    f"{max(n, eng.model_lock.readers)} request(s) are in the engine; abort them "
                    'first (/abort_request {"abort_all": true}) and wait until /get_load '
                    "shows none"
                )
            t0 = time.monotonic()
            new = [t for t in tags if t not in self.released]
            # marked before the first await: a /generate that takes the model lock from here
            # on sees the engine asleep (it checks under the lock)
            self.released.update(tags)
            try:
                if KV_CACHE in new:
                    eng.scheduler.flush_cache()
                    eng.scheduler.kv = None
                if WEIGHTS in new:
                    freed = await eng.scheduler.run_exclusive(self._free_weights)
                    self.last["weights_bytes"] = float(freed)
            except BaseException:
                self.released.difference_update(new)
                raise
            await asyncio.to_thread(trim_heap)  # freed pages back to the node
            self.last["release_s"] = round(time.monotonic() - t0, 4)

    async def resume(self, tags: list[str]) -> None:
        """SGLang's resume; a tag that is not released is refused (ValueError), as SGLang's
        scheduler refuses it."""
        eng = self.engine
        missing = [t for t in tags if t not in self.released]
        if missing:
            raise ValueError(
                f"resume_memory_occupation: tag(s) {missing} are not released (released: "
                f"{sorted(self.released)})"
            )
        async with eng.weights.lock:
            t0 = time.monotonic()
            if WEIGHTS in tags:
                await eng.scheduler.run_exclusive(self._restore_weights)
            self.released.difference_update(tags)
            self.last["resume_s"] = round(time.monotonic() - t0, 4)

    # ------------------------------------------------------------------ the weights
    def _params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.engine.lm.model.named_parameters())  # tied parameters once

    def _free_weights(self) -> int:
        """Write every parameter to the spill file, then free it (the model thread, between
        steps). Returns the bytes freed."""
        from safetensors.torch import save_file

        params = self._params()
        d = self._spill_dir or tempfile.gettempdir()
        os.makedirs(d, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="engine-weights-", suffix=".safetensors", dir=d)
        os.close(fd)
        save_file({k: p.detach().contiguous() for k, p in params.items()}, path)
        self._spill = Path(path)
        freed = 0
        for k, p in params.items():
            self._shapes[k] = (p.shape, p.dtype)
            freed += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype)
        self.engine.lm.borrowed.clear()  # nothing views a weight group's segment any more
        return freed

    def _restore_weights(self) -> None:
        from safetensors.torch import load_file

        assert self._spill is not None
        state = load_file(str(self._spill))
        for k, p in self._params().items():
            shape, dtype = self._shapes[k]
            t = state[k]
            if t.shape != shape or t.dtype != dtype:  # never serve a half-restored model
                raise RuntimeError(f"spilled weight {k} is {t.shape}/{t.dtype}, not {shape}")
            p.data = t.clone()  # anonymous memory, not pages of the spill file
        self._spill.unlink(missing_ok=True)
        self._spill = None
        self._shapes.clear()

    def close(self) -> None:
        if self._spill is not None:
            self._spill.unlink(missing_ok=True)
            self._spill = None
