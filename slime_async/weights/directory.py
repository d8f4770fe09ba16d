"""The directory transports' shared body: a version is a directory the engines load by path.

Owns `DirectoryTransport`, the base of `DiskTransport` (an HF directory of the full weights)
and `AdapterTransport` (a PEFT directory of the LoRA adapter). A push writes version v under
`root/v000007`, hands the directory to `on_written` (the forward-only role's feed), then pauses
generation in place, has the router fan the load out to every engine without a cache flush,
continues (`paused_in_place`), and prunes the directories older than `keep_last` versions. A
failed engine is quarantined by the router, which replays the load before re-admitting it; the
push logs and counts the failure instead of stopping the run. A subclass says how a version is
written (`_save`) and loaded (`_fan_out`).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from router.client import FanoutError, RouterClient
from slime_async.contracts.weights import Payload, version_dir_name, version_of_dir_name
from slime_async.weights.pause import paused_in_place
from slime_async.weights.setup import TransportSetup

log = logging.getLogger(__name__)


class DirectoryTransport:
    """Write → `on_written` → pause in place, router fan-out of the load, continue → prune."""

    payload: ClassVar[Payload]
    shared_filesystem: ClassVar[bool] = True
    writes_directories: ClassVar[bool]
    what: ClassVar[str] = "weight"
    """What a push moves, as its log lines name it ("weight push v7 did not reach ...")."""
    subdir: ClassVar[str]
    """Where versions go, under the run directory (`from_setup`)."""

    def __init__(
        self,
        root: Path,
        *,
        trainer: Any,
        control: RouterClient,
        keep_last: int = 2,
        on_written: Callable[[int, Path], object] | None = None,
    ) -> None:
        self.root, self.trainer, self.control, self.keep_last = root, trainer, control, keep_last
        self.on_written = on_written
        """Called with (version, directory) after a push writes it, before engines load it."""
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> DirectoryTransport:
        """Versions under `<run-dir>/<subdir>`, written by the run's trainer and fanned out by
        its router; a subclass with settings of its own adds them (`_setup_kwargs`)."""
        return cls(
            setup.run_dir / cls.subdir,
            trainer=setup.trainer,
            control=setup.control,
            on_written=setup.on_written,
            **cls._setup_kwargs(setup),
        )

    @classmethod
    def _setup_kwargs(cls, setup: TransportSetup) -> dict[str, Any]:
        return {}

    def directory(self, version: int) -> Path:
        """`root/v000007` for version 7."""
        return self.root / version_dir_name(version)

    async def _save(self, path: Path) -> None:
        """Have the trainer write the current version at `path`."""
        raise NotImplementedError

    async def _fan_out(self, path: Path, version: int, *, strict: bool) -> None:
        """Have every engine load `path` as `version`: `strict` (start-up) raises `FanoutError`
        naming any engine that did not; otherwise (a push) without a cache flush."""
        raise NotImplementedError

    def _push_metrics(self) -> dict[str, float]:
        """What a push reports beyond its timings and failed engines."""
        return {}

    async def write(self, version: int) -> Path:
        """Have the trainer write version `version` (blocking work runs off the event loop)."""
        path = self.directory(version)
        await self._save(path)
        return path

    def _written(self, version: int, path: Path) -> None:
        if self.on_written is not None:
            self.on_written(version, path.resolve())

    async def load(self, version: int) -> None:
        """Have every engine load the already written version `version`; any engine that
        fails raises `FanoutError` naming it (attached engines must all begin on it)."""
        await self._fan_out(self.directory(version).resolve(), version, strict=True)

    async def push(self, version: int) -> dict[str, Any]:
        """Write version `version`, then pause in place, load it on every engine without a
        cache flush, continue; returns timings."""
        t0 = time.perf_counter()
        path = await self.write(version)
        self._written(version, path)
        t1 = time.perf_counter()
        failed = 0
        async with paused_in_place(self.control, version):
            try:
                await self._fan_out(path.resolve(), version, strict=False)
            except FanoutError as e:
                # Engines that failed are quarantined by the router and get this version
                # replayed before re-admission; dead ones are restarted on it by the
                # supervisor. The run goes on; if no engine ever recovers, the supervisor's
                # timeout stops it.
                failed = len(e.reply.get("failed", [])) or 1
                log.warning("%s push v%d did not reach every engine: %s", self.what, version, e)
        t2 = time.perf_counter()
        self._prune(version)
        return {
            "timing/weight_export_s": t1 - t0,
            "timing/weight_load_s": t2 - t1,
            "weights/push_failed_engines": float(failed),
            **self._push_metrics(),
        }

    async def close(self) -> None:
        """Nothing to release (the directories stay for the supervisor's restarts)."""

    def _prune(self, current: int) -> None:
        for d in sorted(self.root.glob("v*")):
            v = version_of_dir_name(d.name)
            if v is not None and v <= current - self.keep_last:
                shutil.rmtree(d, ignore_errors=True)
