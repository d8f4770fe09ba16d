"""Process groups and parallel layout for the trainer (DP, TP+SP, EP, PP with virtual stages).

Owns: `ParallelLayout` (the sizes a checkpoint records), torch.distributed start-up over gloo
(CPU) or NCCL (GPU), megatron `parallel_state` initialisation and release (every group it made is
destroyed: megatron's own `destroy_model_parallel` only forgets most of them, and each forgotten
gloo group keeps its threads and sockets for the life of the process), and small collectives on CPU
tensors (gradient reduction itself is megatron's DDP / `finalize_model_grads`, `optim.py`).
Must never import the controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from slime_async.contracts.model import ModelSpec
from slime_async.host import free_port  # noqa: F401 - the trainer's rendezvous port
from slime_async.trainer import cpu_compat


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """Parallel sizes of one trainer group; `dp` is derived from the world size."""

    tp: int = 1
    """Tensor-parallel size (sequence parallelism is switched on with it for MoE models)."""
    ep: int = 1
    """Expert-parallel size (experts are split across ranks; tokens use the allgather dispatcher)."""
    etp: int = 1
    """Expert tensor-parallel size: how many ranks split each expert's MLP (megatron's
    expert_tensor_parallel_size; the TP size unless set apart)."""
    pp: int = 1
    """Pipeline-parallel size (layers split evenly; megatron's 1F1B schedule)."""
    dp: int = 1
    """Data-parallel size = world_size / (tp * pp)."""

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def resolve_layout(
    *, world_size: int, tp: int, ep: int, pp: int, etp: int | None = None
) -> ParallelLayout:
    """Check the sizes against the world size and derive DP (and ETP = TP when None); raises
    ValueError with the fix. megatron's rules: TP x PP divides the world (the dense layers'
    DP is the rest) and ETP x EP x PP divides it (the experts' DP is the rest)."""
    etp = tp if etp is None else etp
    if tp < 1 or ep < 1 or pp < 1 or etp < 1 or world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tp*pp={tp * pp}; choose sizes whose "
            "product divides the number of trainer processes"
        )
    dp = world_size // (tp * pp)
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"expert tensor-parallel size {etp} x expert parallel size {ep} x pp {pp} must "
            f"divide the world size {world_size} (the experts' data-parallel size is the rest; "
            f"world {world_size} = tp {tp} x pp {pp} x dp {dp} for the dense layers)"
        )
    return ParallelLayout(tp=tp, ep=ep, pp=pp, dp=dp, etp=etp)


def check_model_layout(spec: ModelSpec, layout: ParallelLayout) -> None:
    """Refuse a model the layout cannot split (ValueError naming the sizes)."""
    if spec.is_moe and spec.num_experts % layout.ep:
        raise ValueError(f"num_experts={spec.num_experts} is not divisible by EP={layout.ep}")
    if spec.is_moe and spec.moe_intermediate_size % layout.etp:
        raise ValueError(
            f"moe_intermediate_size={spec.moe_intermediate_size} is not divisible by "
            f"ETP={layout.etp} (each expert's MLP is split over the expert tensor-parallel ranks)"
        )
    if spec.num_layers % layout.pp:
        raise ValueError(f"num_layers={spec.num_layers} is not divisible by PP={layout.pp}")
    if spec.tie_word_embeddings and layout.pp > 1:
        raise ValueError("tied embeddings with pipeline parallelism are not supported; use PP=1")


def init_distributed(
    *, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 300.0
) -> None:
    """Start torch.distributed (gloo on CPU, NCCL on GPU) unless already started. A one-rank
    group rendezvouses in memory (a `HashStore`): it binds no port, so no other process on
    the node can take its port between the probe and the bind."""
    if dist.is_initialized():
        return
    backend = "nccl" if cpu_compat.cuda_available() else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size == 1:
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def init_model_parallel(layout: ParallelLayout, *, seed: int, vp: int | None = None) -> None:
    """Initialise megatron's parallel_state for `layout` (`vp` virtual pipeline stages per
    rank, or None) and seed its RNG tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu_compat.apply()
    release_model_parallel()
    before = set(_registered_groups())
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        virtual_pipeline_model_parallel_size=vp,
    )
    _KEPT_GROUPS[:] = [before]
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


_KEPT_GROUPS: list[set[dist.ProcessGroup]] = []
"""The process groups that existed before `init_model_parallel` (the default one): every group
made after it (megatron's, also those it makes while the model is built) is destroyed by
`release_model_parallel`. Empty: model parallelism is not initialised by this module."""


def _registered_groups() -> list[dist.ProcessGroup]:
    """Every process group torch.distributed holds in this process (the default one too)."""
    if not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_map)


def release_model_parallel() -> None:
    """Undo `init_model_parallel`: megatron's global state, and every process group it made
    (each is destroyed, so its threads and connections end). The default process group stays
    up for reuse; `release_distributed` ends it."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    get_moe_layer_wise_logging_tracker().clear()  # it holds the MoE layers' reduce groups
    RotaryEmbedding.forward.cache_clear()  # its cache holds the modules (and their CP group)
    for name, value in list(vars(ps).items()):  # the globals its destroy forgets to reset
        if isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    if not _KEPT_GROUPS:
        return
    kept = _KEPT_GROUPS.pop()
    for g in _registered_groups():  # those megatron destroyed itself are gone from the list
        if g not in kept:
            dist.destroy_process_group(g)


def drop_stale_graphs(chunks: list[torch.nn.Module]) -> None:
    """Drop the autograd graphs the model's helpers keep from their last forward (megatron's MoE
    token dispatcher keeps its routing probabilities). Through DDP's hooks on that graph's
    gradient accumulators (C++ objects) they close a cycle the garbage collector cannot see:
    the model, its DDP wrapper and the process groups they hold (threads, sockets) would
    outlive the trainer for the life of the process. Call when the model is let go."""
    for chunk in chunks:
        for module in chunk.modules():
            for helper in vars(module).values():
                if isinstance(helper, (torch.nn.Module, type)) or not hasattr(helper, "__dict__"):
                    continue
                for name, value in list(vars(helper).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(helper, name, None)


def release_distributed() -> None:
    """End torch.distributed in this process: the model-parallel groups, then the default
    process group (no-op when not started)."""
    release_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def groups() -> dict[str, dist.ProcessGroup | None]:
    """The process groups the trainer's own collectives use (None when not distributed)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        return {"dp": None, "pp": None}
    return {"dp": ps.get_data_parallel_group(), "pp": ps.get_pipeline_model_parallel_group()}


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_sum(
    t: torch.Tensor, group: dist.ProcessGroup | None, *, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> torch.Tensor:
    """In-place all-reduce over `group` (no-op for a single rank); CPU tensors are staged
    through the GPU when the backend is NCCL."""
    if _size(group) > 1:
        dev = comm_device()
        if t.device != dev:
            staged = t.to(dev)
            dist.all_reduce(staged, op=op, group=group)
            t.copy_(staged.to(t.device))
        else:
            dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_cat(
    t: torch.Tensor, group: dist.ProcessGroup | None, *, dim: int = 0
) -> torch.Tensor:
    """Concatenate equally shaped tensors of all ranks of `group` along `dim` (any device)."""
    n = _size(group)
    if n == 1:
        return t
    dev = comm_device()
    src = t.to(dev).contiguous()
    parts = [torch.empty_like(src) for _ in range(n)]
    dist.all_gather(parts, src, group=group)
    return torch.cat(parts, dim).to(t.device)


def broadcast(t: torch.Tensor, *, src: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank of `group` gets global rank `src`'s `t` (same shape everywhere); in place."""
    if _size(group) > 1:
        staged = t.to(comm_device()).contiguous()
        dist.broadcast(staged, src=src, group=group)
        t.copy_(staged.to(t.device))
    return t


def union_ints(values: set[int], group: dist.ProcessGroup | None, *, cap: int = 64) -> set[int]:
    """Union of small non-negative int sets over `group` (no pickling: a padded int tensor)."""
    n = _size(group)
    if n == 1:
        return set(values)
    if len(values) > cap or min(values, default=0) < 0:
        raise ValueError(f"union_ints takes at most {cap} non-negative ints, got {sorted(values)}")
    row = torch.zeros(cap, dtype=torch.long)  # value + 1; 0 = empty slot
    row[: len(values)] = torch.tensor(sorted(values), dtype=torch.long) + 1
    allv = all_gather_cat(row, group)
    return {int(v) - 1 for v in allv[allv > 0]}


def comm_device() -> torch.device:
    """Where collective buffers must live: CUDA under NCCL, CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
