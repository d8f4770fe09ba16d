"""Packed-sequence (THD) core attention for megatron-core's local layer spec.

Owns: `PackedDotProductAttention`, a drop-in for megatron's local `DotProductAttention` (the
`core_attention` of `get_gpt_layer_local_spec`) that accepts `PackedSeqParams` in THD format.
megatron-core 0.16.1 runs packed sequences only through TransformerEngine's attention
(`TEDotProductAttention`); its local attention asserts `packed_seq_params is None`. Everything
else on the THD path is megatron's own: `GPTModel` sizes RoPE by `max_seqlen`, `SelfAttention`
squeezes q/k/v to `[t, heads, dim]` and applies RoPE per segment of `cu_seqlens` (positions
restart at 0 in every sample), MoE and sequence parallelism see `[t, 1, hidden]`.

Here each segment `cu_seqlens[i]:cu_seqlens[i+1]` runs through the parent's own causal math
(the same `baddbmm` → masked softmax → `bmm` as an unpacked `[s, 1, ...]` sample), so no token
attends across a sample boundary and a packed sample computes exactly what it computes alone.
The cost is Σ nᵢ² per head (no padding), one small attention call per sample. Must never
import anything from `slime_async` outside `slime_async.trainer`.
"""

from __future__ import annotations

import itertools

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    """Local attention that also takes THD-packed inputs (see the module docstring)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: object = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"packed attention supports qkv_format='thd', got {packed_seq_params.qkv_format!r}"
            )
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("packed (THD) attention builds its own causal mask per sample")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if bounds != packed_seq_params.cu_seqlens_kv.tolist():
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        if bounds[-1] != query.shape[0]:
            raise ValueError(
                f"cu_seqlens covers {bounds[-1]} tokens but the packed input has {query.shape[0]}"
            )
        # [t, heads, dim] → per segment [n, 1, heads, dim] → [n, 1, heads * dim]
        out = [
            super(PackedDotProductAttention, self).forward(
                query[s:e].unsqueeze(1), key[s:e].unsqueeze(1), value[s:e].unsqueeze(1), None
            )
            for s, e in itertools.pairwise(bounds)
            if e > s
        ]
        return torch.cat(out, 0)
