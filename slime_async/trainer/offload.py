"""Trainer offload: a rank's parameters, gradients and optimizer state leave memory while the
trainer sleeps, and come back bit for bit; the CPU weight cache of the newest version.

Owns: `TrainerOffload` (one per `MegatronTrainer`, `trainer.offload`) and `WeightCache`.
Offloading works on storages, not tensors: megatron keeps parameters and gradients as views
into contiguous DDP buffers, and the optimizer's fp32 main parameters and Adam moments as
tensors of their own; every distinct storage reachable from the model (parameters, buffers,
`main_grad`, `grad`) and the optimizer (walked generically: its state, groups and attributes)
is written to one spill file and then resized to zero bytes, which frees it while every view
stays valid (the same storage object is resized back and refilled on wake; nothing is
re-created, so the views, the optimizer's references and the DDP hooks all survive). On a GPU
the same walk would move the bytes to host memory instead (not built: CPU storages only).
`WeightCache` holds the HF-named tensors of the newest version the trainer produced (exported
after its step), so the engines can be given that version while the trainer sleeps.
Must never import the controller, engine or rollout parts of `slime_async`.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slime_async.contracts.weights import HFWeights


def _tensors(obj: Any, depth: int, seen: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `obj` through dicts, lists, tuples and object attributes
    (to `depth` levels; each container visited once)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth <= 0 or id(obj) in seen or isinstance(obj, str | bytes | int | float | bool):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(k, depth - 1, seen)
            yield from _tensors(v, depth - 1, seen)
    elif isinstance(obj, list | tuple | set):
        for v in obj:
            yield from _tensors(v, depth - 1, seen)
    elif isinstance(obj, torch.nn.Module):
        return  # modules are walked by `model_tensors` (their parameters and buffers)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("megatron", "torch"):
        yield from _tensors(vars(obj), depth - 1, seen)


def model_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    for p in torch.nn.Module.parameters(model):
        yield p
        for extra in (getattr(p, "main_grad", None), p.grad):
            if isinstance(extra, torch.Tensor):
                yield extra
    yield from torch.nn.Module.buffers(model)  # megatron DDP shadows `buffers` with a list
    for buf in getattr(model, "buffers", ()) if isinstance(model.buffers, list) else ():
        yield from _tensors(buf, depth=4, seen=set())  # its param and grad buffers


def distinct_storages(tensors: Iterator[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages behind `tensors`, each once, in first-seen order (empty ones, and ones
    that cannot be resized, e.g. borrowed from numpy, skipped: those stay)."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.resizable() and s.data_ptr() not in out:
            out[s.data_ptr()] = s
    return list(out.values())


class TrainerOffload:
    """Sleep (`offload`) and wake (`restore`) of one trainer rank."""

    def __init__(self, trainer: Any, *, spill_dir: str | None = None) -> None:
        self.trainer = trainer
        self.spill_dir = spill_dir
        self._held: list[tuple[torch.UntypedStorage, int]] = []
        self._spill: Path | None = None
        self.last: dict[str, float] = {}

    @property
    def asleep(self) -> bool:
        return self._spill is not None

    def _storages(self) -> list[torch.UntypedStorage]:
        tr = self.trainer
        walk = [*model_tensors(tr.model)]
        for wrapped in tr.optim.wrapped:  # the DDP buffers (their params and grads)
            walk += list(model_tensors(wrapped))
        walk += list(_tensors(tr.optim.optimizer, depth=16, seen=set()))
        return distinct_storages(iter(walk))

    def offload(self) -> int:
        """Write every storage to the spill file and free it; returns the bytes freed."""
        if self.asleep:
            return 0
        t0 = time.monotonic()
        storages = self._storages()
        if on := sorted({str(s.device) for s in storages if s.device.type != "cpu"}):
            raise RuntimeError(
                f"trainer offload is built for CPU memory only, and this rank's state is on "
                f"{on}; run with --no-offload-train (the engines still release theirs)"
            )
        d = self.spill_dir or tempfile.gettempdir()
        os.makedirs(d, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="trainer-offload-", suffix=".bin", dir=d)
        total = 0
        with os.fdopen(fd, "wb") as f:
            for s in storages:
                n = s.nbytes()
                # raw bytes: exporting the storage to numpy would pin it (no resize after)
                f.write(ctypes.string_at(s.data_ptr(), n))
                self._held.append((s, n))
                total += n
        for s, _ in self._held:
            s.resize_(0)
        self._spill = Path(path)
        self.last = {"offload_bytes": float(total), "offload_s": time.monotonic() - t0}
        return total

    def restore(self) -> None:
        """Resize every storage back and refill it from the spill file (bit for bit)."""
        if not self.asleep:
            return
        t0 = time.monotonic()
        assert self._spill is not None
        with open(self._spill, "rb") as f:
            for s, n in self._held:
                data = f.read(n)
                if len(data) != n:
                    raise RuntimeError(f"trainer offload file {self._spill} is truncated")
                s.resize_(n)
                ctypes.memmove(s.data_ptr(), data, n)
        self._spill.unlink(missing_ok=True)
        self._spill, self._held = None, []
        self.last["restore_s"] = time.monotonic() - t0


class WeightCache:
    """The newest version's HF-named tensors, on the CPU (what the engines get while the
    trainer sleeps)."""

    def __init__(self) -> None:
        self.weights: HFWeights | None = None

    def put(self, w: HFWeights) -> None:
        self.weights = w

    @property
    def version(self) -> int | None:
        return None if self.weights is None else self.weights.version
