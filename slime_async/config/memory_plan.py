"""The start-up memory check: the bytes each role of a one-node run holds, against the node.

Owns `param_count` (a `ModelSpec`'s parameters), `role_bytes` (per role: the parts it holds ×
the model's bytes) and `fits` (the total against `MEMORY_FRACTION` of the node's memory).
The `memory` rule (`slime_async.config.rules.memory`) uses them to derive
`--behavior-forward trainer` when the forward-only role would not fit but the snapshots in the
trainer would, or to refuse a configuration that cannot fit, with the numbers, before anything starts (instead of Ray's
memory monitor killing a role mid-run). Pure functions; imports only the model contract.

What each role holds, per parameter (N parameters; activations, KV caches and Python itself
are what `MEMORY_FRACTION` leaves room for):

| role | bytes per parameter |
|---|---|
| trainer, fp32 | 4 weights + 4 gradient buffer + 8 Adam moments = 16, + 4 per snapshot |
| trainer, bf16 | 2 weights + 4 fp32 gradient buffer + 4 fp32 main weights + 8 Adam = 18, + 2 per snapshot |
| forward-only role | its weights + one copy per kept version (the parameters' dtype) |
| embedded engine | its weights in the engine dtype (2 for bf16, 4 for fp32) |

With LoRA (A adapter numbers, fp32) the base is frozen and shared: the trainer holds the base
weights + 16 bytes per adapter number (weight, gradient buffer, two Adam moments) + 4 per
adapter number and snapshot; the forward-only role holds the base once + 4 · A per version
(the live one and each kept one).

Under tensor/pipeline parallelism each rank holds 1 / (TP × PP) of the weights; the
distributed optimizer shards the main weights and Adam moments over DP.
"""

from __future__ import annotations

import dataclasses

from slime_async.contracts.model import ModelSpec

MEMORY_FRACTION = 0.8
"""Share of the node's memory the model state may take (Ray's memory monitor kills at 95%)."""
GIB = 1024**3


def param_count(spec: ModelSpec) -> int:
    """Parameters of the model `spec` describes (embeddings, attention, MLP or experts, norms)."""
    h, hd = spec.hidden_size, spec.head_dim
    attn = h * hd * (2 * spec.num_attention_heads + 2 * spec.num_key_value_heads)
    if spec.qkv_bias:
        attn += hd * (spec.num_attention_heads + 2 * spec.num_key_value_heads)
    if spec.qk_norm:
        attn += 2 * hd
    if spec.is_moe:
        mlp = spec.num_experts * 3 * h * spec.moe_intermediate_size + spec.num_experts * h
    else:
        mlp = 3 * h * spec.intermediate_size
    layer = attn + mlp + 2 * h
    embed = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return spec.num_layers * layer + embed + h


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunShape:
    """What sets a one-node run's memory (from the flags)."""

    params: int
    trainer_ranks: int = 1
    tp_pp: int = 1
    """TP × PP: how many ways each rank's weights are split."""
    dp: int = 1
    distributed_optimizer: bool = False
    bf16: bool = False
    trainer_snapshots: int = 0
    """Versions the trainer keeps (`--behavior-forward trainer` with `--keep-old-actor`)."""
    role_versions: int | None = None
    """Versions the forward-only role keeps (None: no role)."""
    engines: int = 0
    """Embedded engines on this node."""
    engine_bytes: int = 2
    """Bytes per parameter of an engine (2 for bf16, 4 for fp32)."""
    adapter_params: int = 0
    """LoRA: numbers in the adapter (`contracts.adapter.adapter_numel`); 0: full fine-tuning."""


def role_bytes(shape: RunShape) -> dict[str, int]:
    """Bytes per role: `trainer` (all ranks), `role` (the forward-only role) and `engines`."""
    w = 2 if shape.bf16 else 4
    per_rank = shape.params // max(1, shape.tp_pp)
    sharded = 8 + (4 if shape.bf16 else 0)  # Adam moments (+ fp32 main weights)
    opt = per_rank * sharded // (shape.dp if shape.distributed_optimizer else 1)
    rank = per_rank * (w + 4) + opt + per_rank * w * shape.trainer_snapshots
    if shape.adapter_params:  # LoRA: the base frozen, gradients and Adam on the adapter only
        a = shape.adapter_params // max(1, shape.tp_pp)
        rank = per_rank * w + a * (16 + 4 * shape.trainer_snapshots)
    out = {"trainer": rank * shape.trainer_ranks}
    if shape.role_versions is not None:
        if shape.adapter_params:  # the base once, an adapter per version
            out["role"] = shape.params * w + shape.adapter_params * 4 * (1 + shape.role_versions)
        else:
            out["role"] = shape.params * w * (1 + shape.role_versions)
    if shape.engines:
        out["engines"] = shape.params * shape.engine_bytes * shape.engines
    return out


def fits(parts: dict[str, int], memory_bytes: int) -> bool:
    return sum(parts.values()) <= MEMORY_FRACTION * memory_bytes


def describe(parts: dict[str, int], memory_bytes: int) -> str:
    """'trainer 7.1 GiB + role 2.2 GiB = 9.3 GiB of 8.0 GiB allowed (80% of 10.0 GiB)'."""
    terms = " + ".join(f"{k} {v / GIB:.1f} GiB" for k, v in parts.items())
    return (
        f"{terms} = {sum(parts.values()) / GIB:.1f} GiB of "
        f"{MEMORY_FRACTION * memory_bytes / GIB:.1f} GiB allowed "
        f"({MEMORY_FRACTION:.0%} of the node's {memory_bytes / GIB:.1f} GiB)"
    )
