"""Weight contracts: one exported policy version, its manifest, and how a run moves versions.

Owns `HFWeights` (what the trainer exports and every transport moves: HF-named full tensors of
version `v` plus the `ModelSpec` they fit), `WeightManifest` (names, dtypes and shapes of a
version's tensors, in a fixed order: what a receiver checks before it swaps anything in, and
the order in which a distributed transport sends the tensors), `WeightTransport` (what the run
needs from a weight transport; the transports live in `slime_async.weights`), `Payload` (what
a transport moves: the full weights or the LoRA adapter alone), `version_dir_name` (the
name of a version's exported HF directory) and `all_finite` (the check every receiver runs
before it serves a tensor). Versions are integers here
and strings on the wire (`weight_version`, SGLang's convention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from clifields import StrEnum
from slime_async.contracts.model import ModelSpec


class Payload(StrEnum):
    """What one push moves from the trainer to the engines."""

    FULL = "full"
    """Every weight of the policy (the engines serve exactly the trainer's model)."""
    ADAPTER = "adapter"
    """The LoRA adapter alone: the engines serve the frozen base they started on (the
    trainer's start-up export) and the pushed adapter over it (docs/lora.md)."""


def version_dir_name(version: int) -> str:
    """Name of the HF directory holding an exported version (`v000007`): the trainer's export
    at start-up and every version the disk transport writes."""
    return f"v{version:06d}"


_FINITE_CHUNK = 1 << 20
"""Elements per `aminmax` in `all_finite`: a chunk that stays in cache is ~3x faster than one
pass over a 100 MB tensor (measured on bf16, docs/results/2026-11-27-weight-sync-floor.md)."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite (no NaN, no ±inf); non-float tensors always are.

    One reduction pass (`aminmax`, which propagates NaN, and an infinity is the min or the
    max) per cache-sized chunk, without the temporaries of `isfinite(t).all()`, which on a CPU
    made the finite check of a bf16 model take longer than receiving it
    (docs/results/2026-11-27-weight-sync-floor.md)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    flat = t.detach().reshape(-1)
    for at in range(0, flat.numel(), _FINITE_CHUNK):
        lo, hi = torch.aminmax(flat[at : at + _FINITE_CHUNK])
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            return False
    return True


def version_of_dir_name(name: str) -> int | None:
    """Inverse of `version_dir_name`; None for a name that is not one."""
    if not name.startswith("v"):
        return None
    try:
        return int(name[1:])
    except ValueError:
        return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HFWeights:
    """One exported policy version: full HF-named tensors (CPU, fp32) and the spec they fit."""

    version: int
    """Trainer version (number of optimizer updates) these weights belong to."""
    spec: ModelSpec
    """Architecture the tensors belong to (`spec.to_hf_config()` is the HF config)."""
    tensors: dict[str, torch.Tensor]
    """HF tensor name → full (unsharded) tensor."""

    def manifest(self) -> WeightManifest:
        """The manifest of these tensors (sorted by name)."""
        return WeightManifest.of(self.tensors, version=self.version)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorEntry:
    """Name, dtype and shape of one tensor."""

    name: str
    """HF tensor name."""
    dtype: str
    """torch dtype without the `torch.` prefix (SGLang's spelling: "bfloat16", "float32")."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightManifest:
    """What a weight version consists of; JSON round-trips through `to_json` / `from_json`."""

    version: int
    """Trainer version of the weights."""
    entries: tuple[TensorEntry, ...]
    """Every tensor, sorted by name (the send order of a distributed transport)."""

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], *, version: int) -> WeightManifest:
        return cls(
            version=version,
            entries=tuple(
                TensorEntry(name=k, dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape))
                for k, t in sorted(tensors.items())
            ),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "names": [e.name for e in self.entries],
            "dtypes": [e.dtype for e in self.entries],
            "shapes": [list(e.shape) for e in self.entries],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WeightManifest:
        names, dtypes, shapes = d["names"], d["dtypes"], d["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"manifest lists {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} "
                "shapes; they must have one entry per tensor"
            )
        return cls(
            version=int(d["version"]),
            entries=tuple(
                TensorEntry(name=str(n), dtype=str(t), shape=tuple(int(x) for x in s))
                for n, t, s in zip(names, dtypes, shapes, strict=True)
            ),
        )


class WeightTransport(Protocol):
    """How a run gives its engines a trainer version: what `slime_async.orchestrator.run.Run` and the
    start-up (`slime_async.orchestrator.launch`) call; built once per run (`--update-weight-transport`).

    Every method is bounded in time; `push` keeps requests in flight alive (pause in place,
    update, continue) and reports engines it could not reach instead of raising.
    """

    payload: ClassVar[Payload]
    """What each push moves: the full weights, or the adapter over the engines' frozen base."""
    shared_filesystem: ClassVar[bool]
    """True: versions travel as files under the run directory that every engine reads (a
    filesystem the engines share). False: the transport hands the engines the tensors, so with
    the full payload engines need not start on the trainer's export (`load` sends it)."""
    writes_directories: ClassVar[bool]
    """True: each pushed version becomes an HF directory (`directory(version)`) on a filesystem
    the engines share, which replacement engines start on. False: versions go straight to the
    engines' memory; no directory exists beyond the run's start-up export."""
    on_written: Callable[[int, Path], object] | None
    """Called with (version, directory) after a push wrote the directory, before any engine
    loads it (the forward-only role's feed); None where nothing listens or nothing is written.
    When set, the run gives the role nothing else."""

    def directory(self, version: int) -> Path:
        """The directory `version` is (or will be) written to; only where `writes_directories`."""
        ...

    async def load(self, version: int) -> None:
        """Have every engine take `version` now (start-up); raises naming any engine that did
        not."""
        ...

    async def push(self, version: int) -> Mapping[str, float]:
        """Give every engine `version` while generation pauses in place; returns timings and
        `weights/push_failed_engines`."""
        ...

    async def close(self) -> None:
        """Release what the transport holds (groups, sessions); written directories stay."""
        ...
