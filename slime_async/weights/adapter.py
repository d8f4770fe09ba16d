"""The adapter transports of a LoRA run: each push moves the adapter only.

Owns `AdapterTransport` (a PEFT directory, the derived one) and `DistributedAdapterTransport`
(the adapter's tensors over the weight update group, `--update-weight-transport distributed`). The engines serve the frozen base (the trainer's start-up export) and
one adapter, `ADAPTER_NAME`, over it. Version v is written by the trainer as a PEFT directory
(`adapter_config.json` + `adapter_model.safetensors` + its sha256) under
`<run-dir>/adapters/v000007`, then pushed like a full-weight version (pause in place →
`/load_lora_adapter {lora_name, lora_path, weight_version}` → continue): in-flight requests
continue under the new adapter with per-token versions (docs/lora.md, "Versions"). The router
logs the load as a weight call and replays it on an engine that missed it, so a restarted
engine serves the fleet's adapter before it generates.

`DistributedAdapterTransport` is the distributed transport (`weights.distributed`: the same
group, buckets, checksums, aborts and resends) carrying the adapter's tensors alone, in PEFT's
names and the adapter's dtype (fp32, never `--update-weight-dtype`: the engines must serve the
trainer's adapter exactly). Every bucket call names the adapter (`lora_name`, `lora_config`);
the engines check the whole adapter as they check a PEFT directory (`check_adapter`) and keep
it staged; then, still inside the pause, the router fans `/load_lora_adapter {lora_name,
weight_version, from_distributed: true}` out, which activates it. That call is a logged weight
call: an engine that missed it gets it replayed before re-admission, and it succeeds only when
that engine holds the adapter of exactly that version (else it stays quarantined until a later
push reaches it), so no engine serves an old adapter under a new label. Both implement
`slime_async.contracts.weights.WeightTransport`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

from router.client import FanoutError, RouterClient
from slime_async.contracts.adapter import ADAPTER_NAME, LoraSpec
from slime_async.contracts.weights import Payload, WeightManifest
from slime_async.weights.directory import DirectoryTransport
from slime_async.weights.distributed import DistributedTransport
from slime_async.weights.setup import TransportSetup

log = logging.getLogger(__name__)


class AdapterWriter(Protocol):
    def save_adapter(self, path: str | Path) -> Path: ...


class AdapterTransport(DirectoryTransport):
    """Adapter → PEFT directory → router fan-out of `/load_lora_adapter` (versioned)."""

    payload: ClassVar[Payload] = Payload.ADAPTER
    writes_directories: ClassVar[bool] = False
    """Versions are adapter directories, not HF models an engine could start on: replacement
    engines start on the base and get the adapter replayed by the router."""
    what: ClassVar[str] = "adapter"
    subdir: ClassVar[str] = "adapters"

    def __init__(
        self,
        root: Path,
        *,
        trainer: AdapterWriter,
        control: RouterClient,
        keep_last: int = 2,
        on_written: Callable[[int, Path], object] | None = None,
    ) -> None:
        super().__init__(
            root, trainer=trainer, control=control, keep_last=keep_last, on_written=on_written
        )
        self.bytes_last = 0
        """Bytes of the last pushed adapter's safetensors file."""

    async def _save(self, path: Path) -> None:
        await asyncio.to_thread(self.trainer.save_adapter, path)
        self.bytes_last = (path / "adapter_model.safetensors").stat().st_size

    async def _fan_out(self, path: Path, version: int, *, strict: bool) -> None:
        if strict:
            await self.control.load_lora_adapter(
                ADAPTER_NAME, str(path), weight_version=version, strict=True
            )
        else:
            await self.control.load_lora_adapter(ADAPTER_NAME, str(path), weight_version=version)

    def _push_metrics(self) -> dict[str, float]:
        return {"weights/push_bytes": float(self.bytes_last)}

    async def load(self, version: int) -> None:
        """Write version `version` and have every engine serve it (start-up); raises
        `FanoutError` naming an engine that did not."""
        self._written(version, await self.write(version))
        await super().load(version)


class DistributedAdapterTransport(DistributedTransport):
    """The adapter alone over the weight update group, activated by a router fan-out (see the
    module docstring). `sender` sends the adapter's tensors (`TrainerGroup.adapter_sender()`).

    Example::

        t = DistributedAdapterTransport(lora=spec, sender=trainer.adapter_sender(),
                                        control=router_client, engine_urls=urls, cfg=cfg)
        await t.push(7)      # pause, broadcast + stage, /load_lora_adapter, continue
    """

    payload: ClassVar[Payload] = Payload.ADAPTER

    def __init__(self, *, lora: LoraSpec, **kw: Any) -> None:
        super().__init__(**kw)
        self.lora = lora

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> DistributedAdapterTransport:
        """The trainer's adapter sender; the run's LoRA spec names the adapter's layout."""
        if setup.lora is None:
            raise ValueError("the distributed adapter transport needs the run's LoRA spec")
        return cls(lora=setup.lora, **cls._setup_kwargs(setup, setup.trainer.adapter_sender()))

    async def _wire_manifest(self) -> WeightManifest:
        """The adapter's own names and dtype: never cast (the engines serve it exactly)."""
        if self._manifest is None:
            self._manifest = await self.sender.manifest()
        return self._manifest

    def _bucket_fields(self) -> dict[str, Any]:
        return {"lora_name": ADAPTER_NAME, "lora_config": self.lora.peft_config()}

    async def _activate(self, version: int, failed: int, *, strict: bool) -> int:
        """Fan `/load_lora_adapter {from_distributed}` out through the router (logged and
        replayed like every weight call); skipped when no engine holds the version (the loaded
        adapter keeps serving everywhere)."""
        if not strict and failed >= len(self.engine_urls()):
            log.warning(
                "adapter push v%d reached no engine; the old adapter keeps serving", version
            )
            return failed
        try:
            await self.control.load_lora_adapter(
                ADAPTER_NAME, None, weight_version=version, strict=strict
            )
        except FanoutError as e:
            if strict:
                raise
            log.warning("adapter activation v%d did not reach every engine: %s", version, e)
            return max(failed, len(e.reply.get("failed", [])) or 1)
        return failed
