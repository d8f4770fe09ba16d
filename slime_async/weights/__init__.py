"""Versioned weight transport from the trainer to the engines.

Owns `DiskTransport` and the package's exports. Both transports push the way SGLang keeps
requests alive across an update: `/pause_generation {"mode": "in_place"}` -> the update with
`flush_cache: false` -> `/continue_generation` (see docs/weight-sync.md). `DiskTransport`: the
trainer writes version v as an HF safetensors directory under the run directory (atomic), then
the router fans `/update_weights_from_disk` (tensors in `--update-weight-dtype`) with `weight_version=str(v)` out to every engine; a
failed engine is quarantined by the router, which replays the load before re-admitting it; the
push logs and counts the failure instead of stopping the run. Old version directories are
pruned. `DistributedTransport` (`weights.distributed`) broadcasts instead, with no filesystem.
Both implement `slime_async.contracts.weights.WeightTransport`; the run uses only that protocol.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

from router.client import FanoutError, RouterClient
from slime_async.contracts.weights import version_dir_name, version_of_dir_name
from slime_async.weights.config import (
    TransportKind,
    WeightSyncConfig,
    add_weight_sync_args,
    weight_sync_config_from_args,
)
from slime_async.weights.distributed import DistributedTransport, WeightSyncError
from slime_async.weights.pause import paused_in_place
from slime_async.weights.sender import InProcessSender, WeightSender

__all__ = [
    "DiskTransport",
    "DistributedTransport",
    "InProcessSender",
    "TransportKind",
    "WeightSender",
    "WeightSyncConfig",
    "WeightSyncError",
    "add_weight_sync_args",
    "weight_sync_config_from_args",
]

log = logging.getLogger(__name__)


class WeightWriter(Protocol):
    def save_weights(self, path: str | Path, *, dtype: str | None = None) -> Path: ...


class DiskTransport:
    """Export -> safetensors directory -> router fan-out of `/update_weights_from_disk`."""

    writes_directories: ClassVar[bool] = True

    def __init__(
        self,
        root: Path,
        *,
        trainer: WeightWriter,
        control: RouterClient,
        keep_last: int = 2,
        on_written: Callable[[int, Path], object] | None = None,
        dtype: str | None = None,
    ) -> None:
        self.root, self.trainer, self.control, self.keep_last = root, trainer, control, keep_last
        self.dtype = dtype
        """Floating-point dtype of the written tensors (None: the trainer's)."""
        self.on_written = on_written
        """Called with (version, directory) after a push writes it, before engines load it."""
        self.root.mkdir(parents=True, exist_ok=True)

    def directory(self, version: int) -> Path:
        """`root/v000007` for version 7."""
        return self.root / version_dir_name(version)

    async def write(self, version: int) -> Path:
        """Have the trainer write version `version` (blocking work runs off the event loop)."""
        path = self.directory(version)
        if self.dtype is None:
            await asyncio.to_thread(self.trainer.save_weights, path)
        else:
            await asyncio.to_thread(self.trainer.save_weights, path, dtype=self.dtype)
        return path

    async def load(self, version: int) -> None:
        """Have every engine load the already written version `version`; any engine that
        fails raises `FanoutError` naming it (attached engines must all begin on it)."""
        path = self.directory(version).resolve()
        await self.control.update_weights_from_disk(str(path), weight_version=version, strict=True)

    async def push(self, version: int) -> dict[str, Any]:
        """Write version `version`, then pause in place, load it on every engine without a
        cache flush, continue; returns timings."""
        t0 = time.perf_counter()
        path = await self.write(version)
        if self.on_written is not None:
            self.on_written(version, path)
        t1 = time.perf_counter()
        failed = 0
        async with paused_in_place(self.control, version):
            try:
                await self.control.update_weights_from_disk(
                    str(path.resolve()), weight_version=version, flush_cache=False
                )
            except FanoutError as e:
                # Engines that failed are quarantined by the router and get this version
                # replayed before re-admission; dead ones are restarted on it by the
                # supervisor. The run goes on; if no engine ever recovers, the supervisor's
                # timeout stops it.
                failed = len(e.reply.get("failed", [])) or 1
                log.warning("weight push v%d did not reach every engine: %s", version, e)
        t2 = time.perf_counter()
        self._prune(version)
        return {
            "timing/weight_export_s": t1 - t0,
            "timing/weight_load_s": t2 - t1,
            "weights/push_failed_engines": float(failed),
        }

    async def close(self) -> None:
        """Nothing to release (the directories stay for the supervisor's restarts)."""

    def _prune(self, current: int) -> None:
        for d in sorted(self.root.glob("v*")):
            v = version_of_dir_name(d.name)
            if v is not None and v <= current - self.keep_last:
                shutil.rmtree(d, ignore_errors=True)
