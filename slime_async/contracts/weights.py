"""Weight contracts: one exported policy version, and the manifest that describes its tensors.

Owns `HFWeights` (what the trainer exports and every transport moves: HF-named full tensors of
version `v` plus the `ModelSpec` they fit) and `WeightManifest` (names, dtypes and shapes of a
version's tensors, in a fixed order: what a receiver checks before it swaps anything in, and
the order in which a distributed transport sends the tensors). Versions are integers here and
strings on the wire (`weight_version`, SGLang's convention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from slime_async.contracts.model import ModelSpec


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
