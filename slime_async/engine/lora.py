"""LoRA serving in the embedded engine: adapters by name over the shared base, applied per row.

Owns: `EngineLora` — the adapters an engine holds (name → `LoadedAdapter`, at most
`max_loaded_loras`), staging one from a PEFT directory (`stage`: read without unpickling,
checked against the served model, the engine's max rank and target modules, before anything
changes) or from tensors received over a weight update group (`stage_tensors`, the same check;
kept in `received` until `/load_lora_adapter {from_distributed: true}` activates them),
activating and unloading by name, and the forward hooks on the HF projections
(`model.layers.{i}.self_attn.q_proj`, ...) that add `(alpha / r) · B A x` to each batch row
under the adapter its request named (`applied(names)` around a forward; a row without an
adapter gets the base model). Must never import the server, the scheduler or aiohttp.

SGLang's semantics: `lora_path` on `/generate` names a loaded adapter; loading a name that is
loaded is refused unless the load carries a `weight_version` (a versioned push: the adapter is
replaced in place between two steps and in-flight requests continue under it with per-token
version spans, docs/weight-sync.md); an adapter that a queued or running request names cannot
be unloaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slime_async.contracts.adapter import (
    ATTENTION_MODULES,
    LoraSpec,
    check_adapter,
    read_peft_dir,
)
from slime_async.contracts.model import ModelSpec

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoadedAdapter:
    """One adapter ready to apply: fp32 (A, B) per (layer, module), and where it came from."""

    name: str
    path: str
    spec: LoraSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    version: int
    """The `weight_version` in the safetensors metadata (0 when absent)."""
    label: str | None = None
    """The `weight_version` string it was received with over a weight group (None: a PEFT
    directory); its activation must name the same one."""


class EngineLora:
    """The adapters of one engine and the hooks that apply them (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: ModelSpec,
        *,
        targets: tuple[str, ...],
        max_rank: int,
        max_loaded: int,
    ) -> None:
        self.spec, self.targets = spec, targets
        self.max_rank, self.max_loaded = max_rank, max_loaded
        self.adapters: dict[str, LoadedAdapter] = {}
        self.received: dict[str, LoadedAdapter] = {}
        """Per name: the newest adapter received over a weight group and checked, not serving
        until `activate` (the distributed adapter push; docs/lora.md)."""
        self._rows: list[str | None] | None = None
        layers = model.get_decoder().layers
        for i, layer in enumerate(layers):
            for m in targets:
                owner = layer.self_attn if m in ATTENTION_MODULES else layer.mlp
                linear = getattr(owner, m, None)
                if linear is None:  # an MoE layer's MLP: no dense projection
                    continue
                linear.register_forward_hook(self._hook(i, m))

    # ------------------------------------------------------------------ adapters
    def stage(self, name: str, path: str) -> LoadedAdapter:
        """Read and check the PEFT directory at `path` (its header against the served model
        before any tensor is read; ValueError / FileNotFoundError naming the problem); nothing
        served changes."""
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name must be a non-empty string")
        lora, tensors, version = read_peft_dir(
            Path(path), model=self.spec, max_rank=self.max_rank, targets=self.targets
        )
        return self.stage_tensors(name, lora, tensors, path=str(path), version=version)

    def stage_tensors(
        self,
        name: str,
        lora: LoraSpec,
        tensors: dict[str, torch.Tensor],
        *,
        path: str,
        version: int = 0,
        label: str | None = None,
    ) -> LoadedAdapter:
        """Check PEFT-keyed adapter tensors exactly as a directory's are (`check_adapter`:
        names, shapes, rank, targets, finite; ValueError naming the problem) and make them an
        adapter ready to activate; nothing served changes."""
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name must be a non-empty string")
        check_adapter(tensors, lora, self.spec, max_rank=self.max_rank, targets=self.targets)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for k, t in tensors.items():
            m = _KEY.search(k)
            assert m is not None  # check_adapter accepted only PEFT's keys
            pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t.float().clone()
        weights = {key: (ab["A"], ab["B"]) for key, ab in pairs.items()}
        return LoadedAdapter(
            name=name, path=path, spec=lora, weights=weights, version=version, label=label
        )

    def activate(self, adapter: LoadedAdapter, *, replace: bool) -> None:
        """Serve `adapter` under its name (call between two forwards)."""
        if adapter.name in self.adapters and not replace:
            raise ValueError(
                f"an adapter named {adapter.name!r} is already loaded; unload it first, or push "
                "a new version of it with weight_version set"
            )
        if adapter.name not in self.adapters and len(self.adapters) >= self.max_loaded:
            raise ValueError(
                f"{len(self.adapters)} adapters are loaded, the engine's --max-loaded-loras; "
                "unload one first"
            )
        self.adapters[adapter.name] = adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"no adapter named {name!r} is loaded (loaded: {self.names()})")
        del self.adapters[name]

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def loaded(self) -> dict[str, str]:
        """{name: path}: SGLang's `loaded_adapters`."""
        return {n: a.path for n, a in sorted(self.adapters.items())}

    # ------------------------------------------------------------------ forwards
    @contextlib.contextmanager
    def applied(self, names: list[str | None]) -> Iterator[None]:
        """Run one forward with row i under adapter `names[i]` (None: the base)."""
        self._rows = names if any(n is not None for n in names) else None
        try:
            yield
        finally:
            self._rows = None

    def _hook(self, layer: int, module: str) -> Any:
        def hook(_mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            rows = self._rows
            if rows is None:
                return out
            x = args[0]
            for name in {n for n in rows if n is not None}:
                ad = self.adapters[name]
                ab = ad.weights.get((layer, module))
                if ab is None:
                    continue
                idx = torch.tensor([i for i, n in enumerate(rows) if n == name])
                a, b = ab
                delta = (x.index_select(0, idx).float() @ a.t()) @ b.t() * ad.spec.scaling
                out = out.index_add(0, idx, delta.to(out.dtype))
            return out

        return hook
