"""Start weights that reach every trainer rank from rank 0, for ranks on nodes that do not hold
the HF directory (no shared filesystem assumed; the driver decides, `slime_async.orchestrator.node_paths`).

Owns `broadcast_hf_weights`: rank 0 reads the directory; a JSON header (version, `ModelSpec`,
tensor names, dtypes, shapes) and then every tensor are broadcast over the trainer's process
group (gloo on CPU; NCCL on GPU, through the rank's device). Nothing is unpickled: the header
is JSON in a byte tensor. Must never import the controller, engine, rollout or data-worker parts
of `slime_async`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weights import HFWeights
from slime_async.trainer import weights_io


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_bytes(data: bytes | None, *, rank: int, dev: torch.device) -> bytes:
    n = torch.tensor([len(data) if rank == 0 and data is not None else 0], dtype=torch.int64)
    n = n.to(dev)
    dist.broadcast(n, src=0)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        if rank == 0 and data is not None
        else torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    )
    dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes() if rank != 0 else (data or b"")


def broadcast_hf_weights(path: str | Path, *, rank: int) -> HFWeights:
    """Every rank calls this (a collective); rank 0 reads `path` and all return its weights.
    A read failure on rank 0 reaches every rank as the same error (no rank is left waiting)."""
    dev = _device()
    w, header = None, None
    if rank == 0:
        try:
            w = weights_io.read_hf_dir(path)
            header = {
                "version": w.version,
                "spec": w.spec.to_dict(),
                "entries": [
                    [k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                    for k, t in sorted(w.tensors.items())
                ],
            }
        except (OSError, ValueError) as e:
            header = {"error": f"trainer rank 0 could not read {path}: {e}"}
    got = json.loads(
        _broadcast_bytes(json.dumps(header).encode() if rank == 0 else None, rank=rank, dev=dev)
    )
    if "error" in got:
        raise FileNotFoundError(got["error"])
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape in got["entries"]:
        if w is not None:
            t = w.tensors[name].contiguous().to(dev)
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
        dist.broadcast(t, src=0)
        tensors[name] = t.cpu()
    return HFWeights(
        version=int(got["version"]), spec=ModelSpec.from_dict(got["spec"]), tensors=tensors
    )
