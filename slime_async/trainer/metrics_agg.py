"""Reduce per-micro-batch metric dicts to one dict per train step (across micro-batches and DP).

Owns: `MetricAccumulator`. Keys ending in `max` reduce with max, keys ending in `min` with min,
all others with a weighted mean (weight = the micro-batch's valid-token count). Percentile
keys (`p50`, `p90`, `p99`) are therefore token-weighted means of per-micro-batch percentiles,
an approximation of the batch percentile. Keys travel between ranks as UTF-8 byte tensors (no
pickling). Must never import the controller, engine, rollout or data-worker parts of
`slime_async`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from slime_async.trainer.parallel import all_gather_cat, all_reduce_sum


def _kind(key: str) -> str:
    tail = key.rsplit("/", 1)[-1]
    if tail.endswith("max"):
        return "max"
    if tail.endswith("min"):
        return "min"
    return "mean"


def _union_keys(keys: list[str], group: dist.ProcessGroup) -> list[str]:
    raw = "\n".join(keys).encode()
    sizes = all_gather_cat(torch.tensor([len(raw)], dtype=torch.long), group)
    width = int(sizes.max())
    buf = torch.zeros(width, dtype=torch.uint8)
    if raw:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    bufs = all_gather_cat(buf, group).view(-1, width)
    out: set[str] = set()
    for b, s in zip(bufs, sizes.tolist()):
        text = bytes(b[:s].tolist()).decode()
        out |= set(text.split("\n")) if text else set()
    return sorted(out)


class MetricAccumulator:
    """Collect `dict[str, float]` per micro-batch; `reduce()` gives the step's metrics."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = {}
        self._w: dict[str, float] = {}
        self._ext: dict[str, float] = {}

    def add(self, metrics: dict[str, float], *, weight: float) -> None:
        for k, v in metrics.items():
            v = float(v)
            if not math.isfinite(v):
                continue
            kind = _kind(k)
            if kind == "mean":
                if weight <= 0:
                    continue
                self._sum[k] = self._sum.get(k, 0.0) + weight * v
                self._w[k] = self._w.get(k, 0.0) + weight
            elif kind == "max":
                self._ext[k] = max(self._ext.get(k, -math.inf), v)
            else:
                self._ext[k] = min(self._ext.get(k, math.inf), v)

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Reduced metrics; with a DP `group`, reduced across its ranks too (collective)."""
        if group is None or dist.get_world_size(group) == 1:
            out = {k: self._sum[k] / self._w[k] for k in self._sum}
            out.update(self._ext)
            return out
        keys = _union_keys(sorted(set(self._sum) | set(self._ext)), group)
        means = [k for k in keys if _kind(k) == "mean"]
        sw = torch.tensor(
            [[self._sum.get(k, 0.0), self._w.get(k, 0.0)] for k in means] or [[0.0, 0.0]],
            dtype=torch.float64,
        )
        all_reduce_sum(sw, group)
        out = {k: float(sw[i, 0] / sw[i, 1]) for i, k in enumerate(means) if sw[i, 1] > 0}
        for kind, op, fill in (
            ("max", dist.ReduceOp.MAX, -math.inf),
            ("min", dist.ReduceOp.MIN, math.inf),
        ):
            ks = [k for k in keys if _kind(k) == kind]
            if not ks:
                continue
            t = torch.tensor([self._ext.get(k, fill) for k in ks], dtype=torch.float64)
            all_reduce_sum(t, group, op=op)
            out.update({k: float(v) for k, v in zip(ks, t.tolist()) if math.isfinite(v)})
        return out


def broadcast_metrics(
    metrics: dict[str, float], *, src: int, group: dist.ProcessGroup
) -> dict[str, float]:
    """Every rank of `group` gets `src`'s metrics (keys as UTF-8 bytes, values as float64)."""
    from slime_async.trainer.parallel import comm_device

    dev = comm_device()
    is_src = dist.get_rank() == src
    keys = sorted(metrics) if is_src else []
    raw = "\n".join(keys).encode()
    head = torch.tensor([len(raw), len(keys)], dtype=torch.long, device=dev)
    dist.broadcast(head, src=src, group=group)
    nbytes, nkeys = (int(x) for x in head.tolist())
    buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    if is_src and raw:
        buf[:nbytes] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    vals = torch.tensor(
        [metrics[k] for k in keys] if is_src else [0.0] * nkeys, dtype=torch.float64
    )
    buf, vals = buf.to(dev), vals.to(dev)
    dist.broadcast(buf, src=src, group=group)
    dist.broadcast(vals, src=src, group=group)
    names = bytes(buf[:nbytes].cpu().tolist()).decode().split("\n") if nbytes else []
    return dict(zip(names, vals.cpu().tolist()))
