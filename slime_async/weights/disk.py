"""The disk transport of the full weights: each version an HF directory every engine loads.

Owns `DiskTransport`: the trainer writes version v as an HF safetensors directory under
`<run-dir>/weights` (atomic; tensors in `--update-weight-dtype`), then the router fans
`/update_weights_from_disk` with `weight_version=str(v)` out to every engine (the push itself is
`DirectoryTransport`'s). Engines and replacement engines can start on these directories, which
needs a filesystem the engines share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

from router.client import RouterClient
from slime_async.contracts.weights import Payload
from slime_async.weights.directory import DirectoryTransport
from slime_async.weights.setup import TransportSetup


class WeightWriter(Protocol):
    def save_weights(self, path: str | Path, *, dtype: str | None = None) -> Path: ...


class DiskTransport(DirectoryTransport):
    """Export -> safetensors directory -> router fan-out of `/update_weights_from_disk`."""

    payload: ClassVar[Payload] = Payload.FULL
    writes_directories: ClassVar[bool] = True
    subdir: ClassVar[str] = "weights"
    """Beside the trainer's start-up export."""

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
        super().__init__(
            root, trainer=trainer, control=control, keep_last=keep_last, on_written=on_written
        )
        self.dtype = dtype
        """Floating-point dtype of the written tensors (None: the trainer's)."""

    @classmethod
    def _setup_kwargs(cls, setup: TransportSetup) -> dict[str, Any]:
        return {"dtype": setup.cfg.dtype}  # --update-weight-dtype

    async def _save(self, path: Path) -> None:
        if self.dtype is None:
            await asyncio.to_thread(self.trainer.save_weights, path)
        else:
            await asyncio.to_thread(self.trainer.save_weights, path, dtype=self.dtype)

    async def _fan_out(self, path: Path, version: int, *, strict: bool) -> None:
        if strict:
            await self.control.update_weights_from_disk(
                str(path), weight_version=version, strict=True
            )
        else:
            await self.control.update_weights_from_disk(
                str(path), weight_version=version, flush_cache=False
            )
