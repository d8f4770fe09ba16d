"""A weight transport plugin: one file, one `register_weight_transport` line (at the end).

`RecordingTransport` moves the full weights as HF directories under `<run-dir>/plugin-weights`,
loaded by every engine like the disk transport's, and records each version it loaded (what
tests/test_weights_registry.py reads). Select it as `tests.plugins.recording_transport:recording`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

from slime_async.contracts.weights import Payload
from slime_async.weights import DirectoryTransport, register_weight_transport


class RecordingTransport(DirectoryTransport):
    payload: ClassVar[Payload] = Payload.FULL
    writes_directories: ClassVar[bool] = True
    subdir: ClassVar[str] = "plugin-weights"

    def __init__(self, root: Path, **kw) -> None:
        super().__init__(root, **kw)
        self.loaded: list[tuple[int, bool]] = []
        """(version, strict) of every load it fanned out."""

    async def _save(self, path: Path) -> None:
        await asyncio.to_thread(self.trainer.save_weights, path)

    async def _fan_out(self, path: Path, version: int, *, strict: bool) -> None:
        self.loaded.append((version, strict))
        await self.control.update_weights_from_disk(str(path), weight_version=version)


register_weight_transport("recording", RecordingTransport)
