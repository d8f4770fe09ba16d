"""The `torch_dist` checkpoint format: every rank writes its own shards of the weights and of
the optimizer state through megatron-core's `dist_checkpointing` (PyTorch Distributed
Checkpoint files), and any layout reads back the slices it owns.

Owns: the sharded state dict of one trainer rank (each model chunk's own `sharded_state_dict()`,
`model_state`, and the optimizer state as `ShardedTensor`s keyed by the model tensor it belongs
to), `walk` / `get` over such nested dicts, `save` and `load` of a checkpoint's `dist/`
directory. Must never import the controller, engine, rollout or
data-worker parts of `slime_async`; `checkpoint.py` owns the directory around `dist/`
(meta.json, checksums, rename).

Why the optimizer's tensors are built here and not by megatron's
`optimizer.sharded_state_dict(...)`: in megatron-core 0.16.1 the distributed optimizer's only
form that survives a TP/PP/DP change, `fully_sharded_model_space`, raises
`ShardedTensor.flattened_range is not supported`; `fully_reshardable` gathers the state over DP
at save (the memory this format exists to avoid) and `dp_reshardable` fixes TP/PP and the
optimizer kind. So each DP rank's flat slice [lo, hi) of a parameter's state is cut into
rectangular blocks (`blocks`) placed at the model tensor's global offset, under megatron's key
names, and `dist_checkpointing` writes and reshards them like any model tensor.

What is saved: only the tensors (`ShardedTensor`s). The optimizer's non-tensor state (param
groups: LR, betas, weight decay) is not: it is a function of the flags and the version (the LR
schedule is `optim.lr_at`), and Adam's step count is meta.json's `optimizer_step`. Hence a
checkpoint of the distributed optimizer loads into the plain one and back (the same tensor keys
`optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<model key>`), and TP/EP/PP/DP change by
megatron's resharding (each rank reads the slices of the global tensors it owns).

Memory: a save holds no full tensor anywhere (each rank writes the shards it already holds);
a load reads only this rank's slices.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

SUBDIR = "dist"
"""The checkpoint's subdirectory that `dist_checkpointing` writes."""
STATE_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "main_param": "fp32_param"}
"""`MegatronOptim.owned_state` key -> the state name in the checkpoint's tensor keys
(`optimizer.state.<name>.<model key>`, megatron's names)."""


def walk(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) of every `ShardedBase` / `ShardedTensorFactory` in a nested dict / list."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    if isinstance(tree, ShardedBase | ShardedTensorFactory):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from walk(v, (*path, k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from walk(v, (*path, i))


def get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def blocks(start: int, end: int, shape: tuple[int, ...]) -> list[tuple[tuple, tuple]]:
    """The flat range [start, end) of a contiguous tensor of `shape` as rectangular blocks
    [(offset, block shape)], each contiguous in memory, in order.

    Example: `blocks(2, 9, (3, 4))` -> `[((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 1))]`.
    """
    if start >= end:
        return []
    if len(shape) == 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)

    def within(r: int, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
        return [((r, *o), (1, *s)) for o, s in blocks(lo - r * row, hi - r * row, shape[1:])]

    first, last = -(-start // row), end // row  # the full rows are [first, last)
    if first > last:  # inside one row
        return within(start // row, start, end)
    out = within(first - 1, start, first * row) if start < first * row else []
    if last > first:
        out.append(((first, *zeros), (last - first, *shape[1:])))
    if end > last * row:
        out += within(last, last * row, end)
    return out


def _regions(leaf: Any) -> list[tuple[Any, int]]:
    """[(ShardedTensor, its start in the parameter's flat local tensor)] of one model leaf: the
    tensor itself, or the pieces a `ShardedTensorFactory` (swiglu's fc1 under TP) cuts it in."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if not isinstance(leaf, ShardedTensorFactory):
        return [(leaf, 0)]
    built = leaf.build()
    pieces = [sh for _, sh in walk(built)]
    base = leaf.data.storage_offset()
    out = []
    for sh in pieces:
        if not sh.data.is_contiguous():
            raise NotImplementedError(f"non-contiguous piece {sh.key} of a sharded factory")
        out.append((sh, sh.data.storage_offset() - base))
    return out


def _optimizer_tensors(tr: Any, model: dict[str, Any], *, with_main: bool) -> dict[str, Any]:
    """The optimizer state this rank holds, as `ShardedTensor`s in the model's global index
    space: the state of a parameter's slice [lo, hi) (a DP shard of the distributed optimizer)
    is cut into rectangular blocks placed at the model tensor's global offset. Data are views of
    the live state (a save writes them, a load copies into them)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    meta: dict[Any, Any] = {}
    for _, leaf in walk(model):
        meta.setdefault(leaf.data, leaf)  # a tied output layer repeats the embedding: first wins
    out: dict[str, Any] = {}
    for p, (lo, hi), views in tr.optim.owned_state():
        for sh, at in _regions(meta[p]):
            n = math.prod(sh.local_shape)
            a, b = max(lo, at), min(hi, at + n)
            pre = sh.prepend_axis_num
            replica = sh.replica_id  # the plain optimizer: replicated like the weights
            if tr.optim.distributed and isinstance(replica, tuple):  # DP ranks: disjoint slices
                replica = (*replica[:2], 0)
            for off, shape in blocks(a - at, b - at, tuple(sh.local_shape)):
                flat0 = at + sum(o * s for o, s in zip(off, _strides(sh.local_shape))) - lo
                numel = math.prod(shape)
                full = (1,) * pre + shape  # megatron's prepended axes (expert index), explicit
                offset = (
                    *sh.global_offset[:pre],
                    *(g + o for g, o in zip(sh.global_offset[pre:], off)),
                )
                for k, view in views.items():
                    if k == "main_param" and not with_main:
                        continue
                    name = f"optimizer.state.{STATE_KEYS[k]}.{sh.key}"
                    ten = ShardedTensor(
                        key=name,
                        data=view[flat0 : flat0 + numel].view(full),
                        dtype=view.dtype,
                        local_shape=full,
                        global_shape=tuple(sh.global_shape),
                        global_offset=offset,
                        axis_fragmentations=None,
                        replica_id=replica,
                    )
                    out[f"{name}@{offset}"] = ten
    return out


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _tensors_only(sd: dict[str, Any]) -> dict[str, Any]:
    """A chunk's sharded state dict without its `ShardedObject`s: megatron's local layers give
    an empty `_extra_state` object per linear layer, which the format would pickle (and a load
    unpickle); one that holds data (a TransformerEngine layer's) is refused."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    for k, v in sd.items():
        if isinstance(v, ShardedObject) and v.data is not None:
            raise NotImplementedError(
                f"{k} holds non-tensor state, which --ckpt-format torch_dist does not save; "
                "use --ckpt-format torch"
            )
    return {k: v for k, v in sd.items() if not isinstance(v, ShardedObject)}


def model_state(chunk: Any) -> dict[str, Any]:
    """One model chunk's sharded state dict, its tensors only (megatron's keys: what a Megatron
    torch_dist checkpoint of the same architecture holds, slime's included)."""
    return _tensors_only(chunk.sharded_state_dict())


def _state_dict(tr: Any, *, with_main: bool) -> dict[str, Any]:
    """{"model": {chunk i: its sharded state dict}, "optimizer": the state's sharded tensors}."""
    model = {f"model{i}": model_state(c) for i, c in enumerate(tr.chunks)}
    return {"model": model, "optimizer": _optimizer_tensors(tr, model, with_main=with_main)}


def save(tr: Any, ckpt_dir: Path) -> None:
    """Every rank writes its shards into `ckpt_dir/dist/` (collective; `ckpt_dir` exists)."""
    from megatron.core import dist_checkpointing

    target = ckpt_dir / SUBDIR
    if tr.rank == 0:
        target.mkdir()
    if torch.distributed.is_initialized() and tr.world_size > 1:
        torch.distributed.barrier()
    if tr.optim.step_count() == 0:
        tr.optim.init_state(step=0)
    dist_checkpointing.save(_state_dict(tr, with_main=tr.optim.bf16), str(target))


@torch.no_grad()
def load(tr: Any, ckpt_dir: Path, *, step: int) -> None:
    """Read this rank's slices of the weights and the optimizer state from `ckpt_dir/dist/`
    into the live tensors (collective); Adam's step count is set to `step`."""
    from megatron.core import dist_checkpointing

    tr.optim.init_state(step=step)
    template = _state_dict(tr, with_main=tr.optim.bf16)
    dests = [(path, leaf.data) for path, leaf in walk(template)]
    loaded = dist_checkpointing.load(template, str(ckpt_dir / SUBDIR))
    for path, dest in dests:
        dest.copy_(get(loaded, path).view_as(dest))
