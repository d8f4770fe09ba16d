"""Token log-probs and entropies from logits whose vocabulary is split over tensor-parallel ranks.

Owns: `vocab_parallel_logprobs` (per-token log π and entropy from `[N, V/TP]` logit shards, the
form Megatron's output layer hands a loss when `parallel_output=True`, as slime's custom losses
receive it) and `megatron_tp_group` (the tensor-parallel group, when megatron-core is
initialised). Must never import `slime_async`; megatron-core is imported lazily, only for TP > 1.

Math, per position with shards `x_r` of the logits (`r` = TP rank, columns `[r·V/TP, (r+1)·V/TP)`):

    m   = max_r max_v x_r,v                        (all-reduce MAX, no gradient: a shift)
    S   = Σ_r Σ_v exp(x_r,v − m)                   (all-reduce SUM)
    lp  = (x_target − m) − log S                   (the target lives on one rank; the others add 0)
    H   = log S − Σ_r Σ_v p_v·(x_r,v − m),   p = exp(x − m) / S

The sums cross ranks through megatron-core's `reduce_from_tensor_model_parallel_region`: an
all-reduce forward and the identity backward, Megatron's convention for a loss every TP rank
computes identically, so each rank receives exactly the gradient of its own shard.
"""

from __future__ import annotations

from typing import Any

import torch

from loss.types import upcast


def megatron_tp_group() -> Any | None:
    """megatron-core's tensor-parallel group when it is initialised with TP > 1, else None."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return None
    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


def megatron_cp_size() -> int:
    """megatron-core's context-parallel world size (1 when it is not initialised)."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return 1
    if not ps.model_parallel_is_initialized():
        return 1
    return int(ps.get_context_parallel_world_size())


def _group_rank_size(group: Any | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: Any | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs `[N]`, entropies `[N]` or None) of `targets` `[N]` under `logits` `[N, V_local]`.

    `group`: the tensor-parallel process group whose ranks hold consecutive vocabulary shards of
    equal width (rank r holds columns `[r·V_local, (r+1)·V_local)`); None means the logits hold
    the whole vocabulary. bf16/fp16 logits are upcast to fp32; the input is never modified.
    Gradient flows to `logits` (entropy's too, when asked).
    """
    if logits.dim() != 2 or targets.dim() != 1 or logits.shape[0] != targets.shape[0]:
        raise ValueError(
            f"expected logits [N, V] and targets [N], got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}."
        )
    rank, size = _group_rank_size(group)
    v_local = logits.shape[-1]
    targets = targets.to(logits.device).long()
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= v_local * size):
        raise ValueError(
            f"token id {int(targets.max())} is outside the vocabulary: these logits hold "
            f"{v_local} columns x {size} tensor-parallel rank(s). If the logits are one shard of "
            "a vocab-parallel output layer, pass its tensor-parallel group (megatron's "
            "parallel_state must be initialised, or give group=)."
        )
    x = upcast(logits)
    with torch.no_grad():
        m = x.max(dim=-1).values
        if size > 1:
            import torch.distributed as dist

            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = x - m.unsqueeze(-1)
    e = z.exp()
    start = rank * v_local
    local = (targets >= start) & (targets < start + v_local)
    idx = (targets - start).clamp(0, v_local - 1).unsqueeze(-1)
    picked = torch.where(local, z.gather(-1, idx).squeeze(-1), 0.0)
    parts = [e.sum(-1), picked]
    if with_entropy:
        parts.append((e * z).sum(-1))
    stacked = _reduce(torch.stack(parts), group, size)
    log_s = stacked[0].log()
    lp = stacked[1] - log_s
    ent = log_s - stacked[2] / stacked[0] if with_entropy else None
    return lp, ent


def _reduce(x: torch.Tensor, group: Any | None, size: int) -> torch.Tensor:
    """Sum over the TP group: all-reduce forward, identity backward (megatron-core's mapping)."""
    if size == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x.contiguous(), group=group)
