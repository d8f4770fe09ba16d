"""Process groups and parallel layout for the trainer (DP, TP+SP, EP; PP refused for now).

Owns: `ParallelLayout` (the sizes a checkpoint records), torch.distributed start-up over gloo
(CPU) or NCCL (GPU), megatron `parallel_state` initialisation, and the gradient
synchronisation the plain (non-DDP) optimizer path needs. Must never import the controller,
engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Iterable

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
    pp: int = 1
    """Pipeline-parallel size (layers split evenly; sequential stage schedule)."""
    dp: int = 1
    """Data-parallel size = world_size / (tp * pp)."""

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def resolve_layout(*, world_size: int, tp: int, ep: int, pp: int) -> ParallelLayout:
    """Check the sizes against the world size and derive DP; raises ValueError with the fix."""
    if tp < 1 or ep < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tp*pp={tp * pp}; choose sizes whose "
            "product divides the number of trainer processes"
        )
    dp = world_size // (tp * pp)
    if dp % ep:
        raise ValueError(
            f"expert parallel size {ep} must divide the data-parallel size {dp} (world "
            f"{world_size} = tp {tp} x pp {pp} x dp {dp}; experts are TP-sharded like dense layers)"
        )
    return ParallelLayout(tp=tp, ep=ep, pp=pp, dp=dp)


def check_model_layout(spec: ModelSpec, layout: ParallelLayout) -> None:
    """Refuse a model the layout cannot split (ValueError naming the sizes)."""
    if spec.is_moe and spec.num_experts % layout.ep:
        raise ValueError(f"num_experts={spec.num_experts} is not divisible by EP={layout.ep}")
    if spec.num_layers % layout.pp:
        raise ValueError(f"num_layers={spec.num_layers} is not divisible by PP={layout.pp}")
    if spec.tie_word_embeddings and layout.pp > 1:
        raise ValueError("tied embeddings with pipeline parallelism are not supported; use PP=1")


def init_distributed(
    *, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 300.0
) -> None:
    """Start torch.distributed (gloo on CPU, NCCL on GPU) unless already started."""
    if dist.is_initialized():
        return
    backend = "nccl" if cpu_compat.cuda_available() else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_model_parallel(layout: ParallelLayout, *, seed: int) -> None:
    """Initialise megatron's parallel_state for `layout` and seed its RNG tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu_compat.apply()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def groups() -> dict[str, dist.ProcessGroup | None]:
    """The process groups the trainer reduces over (None when not distributed)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        return {"dp": None, "tp": None, "pp": None, "mp": None, "edp": None, "emp": None}
    return {
        "dp": ps.get_data_parallel_group(),
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "mp": ps.get_model_parallel_group(),
        "edp": ps.get_expert_data_parallel_group(),
        "emp": ps.get_expert_tensor_model_pipeline_parallel_group(),
    }


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


def is_expert_param(name: str) -> bool:
    """Routed-expert weights (reduced over the expert-data-parallel group)."""
    return ".experts." in name


def is_tp_partitioned(p: torch.nn.Parameter) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def needs_tp_grad_reduce(name: str, p: torch.nn.Parameter) -> bool:
    """Replicated params whose grads differ across TP ranks (SP norms/router, qk-norms)."""
    if is_tp_partitioned(p) or is_expert_param(name):
        return False
    parent = name.split(".")[-2] if "." in name else ""
    return bool(getattr(p, "sequence_parallel", False)) or parent in ("q_layernorm", "k_layernorm")


def sync_grads(named_params: Iterable[tuple[str, torch.nn.Parameter]], *, tp: int) -> None:
    """Sum grads over DP (dense) / expert-DP (experts), and over TP where partial.

    Losses are already each rank's *share* of the global loss (global denominators), so the
    right reduction over data-parallel copies is a SUM, not a mean.
    """
    g = groups()
    for name, p in named_params:
        if p.grad is None:
            continue
        if tp > 1 and needs_tp_grad_reduce(name, p):
            all_reduce_sum(p.grad, g["tp"])
        all_reduce_sum(p.grad, g["edp"] if is_expert_param(name) else g["dp"])


def grad_norm(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> torch.Tensor:
    """Global L2 norm of the gradients, counting every distinct parameter shard once."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank() if dist.is_initialized() else 0
    dense_sq: list[torch.Tensor] = []
    expert_sq: list[torch.Tensor] = []
    for name, p in named_params:
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()  # stays on the grad's device (no sync)
        if is_expert_param(name):
            expert_sq.append(sq)
        elif is_tp_partitioned(p) or tp_rank == 0:
            dense_sq.append(sq)
    dense = torch.stack(dense_sq).sum().cpu() if dense_sq else torch.zeros((), dtype=torch.float64)
    expert = (
        torch.stack(expert_sq).sum().cpu() if expert_sq else torch.zeros((), dtype=torch.float64)
    )
    g = groups()
    all_reduce_sum(dense, g["mp"])  # TP shards and pipeline stages hold distinct params
    all_reduce_sum(expert, g["emp"])
    return (dense + expert).sqrt()


def clip_grads_(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], norm: float, max_norm: float
) -> None:
    """Scale the gradients by max_norm / norm when `norm` (their global norm) exceeds
    `max_norm` > 0; `max_norm` = 0 disables clipping."""
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for _, p in named_params:
            if p.grad is not None:
                p.grad.mul_(scale)
