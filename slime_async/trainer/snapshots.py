"""Bounded store of past-version weight snapshots (CPU copies of this rank's shards).

Owns: `SnapshotStore` — keep/release version-j weights (with LoRA the adapters only, MBs per
version) and swap them into the model for a π_j^Meg forward. Must never import the controller,
engine, rollout or data-worker parts of `slime_async`.

Worked example (max_snapshots = 2): snapshot(0), snapshot(1), snapshot(2) → versions {1, 2}
(0 evicted, oldest first); release(1) → {2}; `swapped_in(model, 2)` runs the body with
version-2 weights and restores the current ones afterwards, even on error.

A model that only reads its weights (the forward-only role) keeps its versions without copies:
`vacate` (the parameters on storage no version holds: the evicted oldest version's when full),
load the new version into the model, `adopt` (the store keeps the parameters' tensors as that
version), and `pointed_at(model, v)` points the parameters at version v's tensors for a
forward. The role then holds exactly its versions: no current copy, no swap copy. Or, where a
version arrives as tensors in the parameters' layout (the trainer's mapped file of them),
`adopt_tensors` keeps those tensors as the version and points the parameters at them.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch


class SnapshotStore:
    """Version → CPU state (parameters only) with FIFO eviction beyond `max_snapshots`."""

    def __init__(self, max_snapshots: int, *, keep: Callable[[str], bool] | None = None) -> None:
        if max_snapshots < 1:
            raise ValueError("max_snapshots must be >= 1")
        self.max_snapshots = max_snapshots
        self.keep = keep
        """Which parameters a snapshot holds (by name; None: all). With LoRA the adapters
        only: the frozen base is shared by every version."""
        self._store: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    def versions(self) -> list[int]:
        return list(self._store)

    def __contains__(self, version: int) -> bool:
        return version in self._store

    @torch.no_grad()
    def snapshot(self, model: torch.nn.Module, version: int) -> list[int]:
        """Keep a CPU copy of the model's parameters (those `keep` names) as `version`;
        returns evicted versions."""
        return self._keep(
            version,
            {
                n: p.detach().to("cpu", copy=True)
                for n, p in model.named_parameters()
                if self.keep is None or self.keep(n)
            },
        )

    def _keep(self, version: int, tensors: dict[str, torch.Tensor]) -> list[int]:
        """Store `tensors` as `version` (the newest); evict the oldest beyond `max_snapshots`
        and return the evicted versions."""
        self._store[version] = tensors
        self._store.move_to_end(version)
        evicted = []
        while len(self._store) > self.max_snapshots:
            v, _ = self._store.popitem(last=False)
            evicted.append(v)
        return evicted

    @torch.no_grad()
    def vacate(self, model: torch.nn.Module) -> list[int]:
        """Before loading a new version into `model` in place (`adopt` after): give the
        parameters this store keeps storage that no kept version shares. When the store is
        full, the oldest version is evicted and, with every parameter kept (`keep` None: an
        import writes all of them), its tensors are reused: nothing is allocated. Returns the
        evicted versions."""
        evicted, reuse = [], None
        if len(self._store) >= self.max_snapshots:
            v, reuse = self._store.popitem(last=False)
            evicted.append(v)
        held = {t.data_ptr() for snap in self._store.values() for t in snap.values()}
        for n, p in model.named_parameters():
            if self.keep is not None and not self.keep(n):
                continue
            if reuse is not None and self.keep is None:
                p.data = reuse[n]
            elif p.data_ptr() in held:
                p.data = p.data.clone()
        return evicted

    def adopt(self, model: torch.nn.Module, version: int) -> list[int]:
        """Keep `model`'s parameters (those `keep` names) as `version` without copying them:
        the model and the store share the tensors until `vacate` (the forward-only role loads
        each version into its model, then keeps it this way). Returns evicted versions."""
        return self._keep(
            version,
            {n: p.data for n, p in model.named_parameters() if self.keep is None or self.keep(n)},
        )

    def adopt_tensors(
        self, model: torch.nn.Module, version: int, tensors: dict[str, torch.Tensor]
    ) -> list[int]:
        """Keep `tensors` (every parameter kept, by name, in the parameters' dtype and shape:
        a mapped file's views, say) as `version` and point `model`'s parameters at them, the
        newest version's: nothing is copied or allocated. Returns evicted versions."""
        params = {n: p for n, p in model.named_parameters() if self.keep is None or self.keep(n)}
        if tensors.keys() != params.keys():
            gone, extra = (
                sorted(params.keys() - tensors.keys()),
                sorted(tensors.keys() - params.keys()),
            )
            raise ValueError(
                f"v{version}: the tensors are not this model's parameters (missing {gone[:3]}, "
                f"unknown {extra[:3]})"
            )
        for n, p in params.items():
            t = tensors[n]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise ValueError(
                    f"v{version}: {n} is {t.dtype} {tuple(t.shape)}, the model's parameter "
                    f"{p.dtype} {tuple(p.shape)}"
                )
        for n, p in params.items():
            p.data = tensors[n]
        return self._keep(version, dict(tensors))

    @contextlib.contextmanager
    def pointed_at(self, model: torch.nn.Module, version: int) -> Iterator[None]:
        """Run the body with `model`'s parameters pointing at `version`'s tensors (no copy;
        for a model that only reads its weights); the previous tensors come back after."""
        snap = self.state(version)
        params = {n: p for n, p in model.named_parameters() if n in snap}
        before = {n: p.data for n, p in params.items()}
        for n, p in params.items():
            p.data = snap[n]
        try:
            yield
        finally:
            for n, p in params.items():
                p.data = before[n]

    def release(self, version: int) -> bool:
        """Drop `version`; True if it was held."""
        return self._store.pop(version, None) is not None

    def state(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self._store:
            raise KeyError(f"no snapshot of version {version}; held: {self.versions()}")
        return self._store[version]

    @contextlib.contextmanager
    def swapped_in(self, model: torch.nn.Module, version: int) -> Iterator[None]:
        """Run the body with `version`'s weights loaded; the current weights come back after."""
        snap = self.state(version)
        params = {n: p for n, p in model.named_parameters() if n in snap}
        with torch.no_grad():
            current = {n: p.detach().clone() for n, p in params.items()}
            for n, p in params.items():
                p.copy_(snap[n].to(p.device))
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(current[n])
