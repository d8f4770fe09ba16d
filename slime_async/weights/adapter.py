"""The adapter transport of a LoRA run: each push moves the adapter only, as a PEFT directory.

Owns `AdapterTransport`. The engines serve the frozen base (the trainer's start-up export) and
one adapter, `ADAPTER_NAME`, over it. Version v is written by the trainer as a PEFT directory
(`adapter_config.json` + `adapter_model.safetensors` + its sha256) under
`<run-dir>/adapters/v000007`, then pushed like a full-weight version (pause in place →
`/load_lora_adapter {lora_name, lora_path, weight_version}` → continue): in-flight requests
continue under the new adapter with per-token versions (docs/lora.md, "Versions"). The router
logs the load as a weight call and replays it on an engine that missed it, so a restarted
engine serves the fleet's adapter before it generates. Implements
`slime_async.contracts.weights.WeightTransport`.
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
from slime_async.contracts.adapter import ADAPTER_NAME
from slime_async.contracts.weights import version_dir_name, version_of_dir_name
from slime_async.weights.pause import paused_in_place

log = logging.getLogger(__name__)


class AdapterWriter(Protocol):
    def save_adapter(self, path: str | Path) -> Path: ...


class AdapterTransport:
    """Adapter → PEFT directory → router fan-out of `/load_lora_adapter` (versioned)."""

    writes_directories: ClassVar[bool] = False
    """Versions are adapter directories, not HF models an engine could start on: replacement
    engines start on the base and get the adapter replayed by the router."""

    def __init__(
        self, root: Path, *, trainer: AdapterWriter, control: RouterClient, keep_last: int = 2
    ) -> None:
        self.root, self.trainer, self.control, self.keep_last = root, trainer, control, keep_last
        self.on_written: Callable[[int, Path], object] | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self.bytes_last = 0
        """Bytes of the last pushed adapter's safetensors file."""

    def directory(self, version: int) -> Path:
        """`root/v000007` for version 7 (the adapter's PEFT directory)."""
        return self.root / version_dir_name(version)

    async def _write(self, version: int) -> Path:
        path = self.directory(version)
        await asyncio.to_thread(self.trainer.save_adapter, path)
        self.bytes_last = (path / "adapter_model.safetensors").stat().st_size
        return path.resolve()

    async def load(self, version: int) -> None:
        """Write version `version` and have every engine serve it (start-up); raises
        `FanoutError` naming an engine that did not."""
        path = await self._write(version)
        await self.control.load_lora_adapter(
            ADAPTER_NAME, str(path), weight_version=version, strict=True
        )

    async def push(self, version: int) -> dict[str, Any]:
        """Write the adapter of `version`, then pause in place, load it on every engine,
        continue; returns timings and the bytes moved."""
        t0 = time.perf_counter()
        path = await self._write(version)
        t1 = time.perf_counter()
        failed = 0
        async with paused_in_place(self.control, version):
            try:
                await self.control.load_lora_adapter(
                    ADAPTER_NAME, str(path), weight_version=version
                )
            except FanoutError as e:  # quarantined by the router, replayed on re-admission
                failed = len(e.reply.get("failed", [])) or 1
                log.warning("adapter push v%d did not reach every engine: %s", version, e)
        t2 = time.perf_counter()
        self._prune(version)
        return {
            "timing/weight_export_s": t1 - t0,
            "timing/weight_load_s": t2 - t1,
            "weights/push_failed_engines": float(failed),
            "weights/push_bytes": float(self.bytes_last),
        }

    async def close(self) -> None:
        """Nothing to release."""

    def _prune(self, current: int) -> None:
        for d in sorted(self.root.glob("v*")):
            v = version_of_dir_name(d.name)
            if v is not None and v <= current - self.keep_last:
                shutil.rmtree(d, ignore_errors=True)
