"""Packed-sequence (THD) core attention for megatron-core's local layer spec.

Owns: `PackedDotProductAttention`, a drop-in for megatron's local `DotProductAttention` (the
`core_attention` of `get_gpt_layer_local_spec`) that accepts `PackedSeqParams` in THD format.
megatron-core 0.16.1 runs packed sequences only through TransformerEngine's attention
(`TEDotProductAttention`); its local attention asserts `packed_seq_params is None`. Everything
else on the THD path is megatron's own: `GPTModel` sizes RoPE by `max_seqlen`, `SelfAttention`
squeezes q/k/v to `[t, heads, dim]` and applies RoPE per segment of `cu_seqlens` (positions
restart at 0 in every sample), MoE and sequence parallelism see `[t, 1, hidden]`.

Here each segment `cu_seqlens[i]:cu_seqlens[i+1]` runs through
`torch.nn.functional.scaled_dot_product_attention` with a causal mask (the same math as the
parent's `baddbmm` → masked softmax → `bmm`, with the parent's softmax scale), so no token
attends across a sample boundary and a packed sample computes exactly what it computes alone.
An unpacked (BSHD, right-padded) micro-batch takes the same call. SDPA picks a fused kernel
(flash / memory-efficient on a GPU, the fused CPU kernel on a CPU), so no `[heads, n, n]` score
matrix is materialised; the cost is Σ nᵢ² per head (no padding), one call per sample. Settings
SDPA does not express (a given mask or bias, a non-vanilla softmax) run the parent's math.
Parameter names are the parent's (it has none with the vanilla softmax). Must never import
anything from `slime_async` outside `slime_async.trainer`.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
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
        fused = (
            self.config.softmax_type == "vanilla"
            and not self.config.apply_query_key_layer_scaling
            and attention_bias is None
        )
        if packed_seq_params is None:
            if fused and attention_mask is None:
                return self._causal(query, key, value)
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
        one = self._causal if fused else super().forward
        out = [
            one(query[s:e].unsqueeze(1), key[s:e].unsqueeze(1), value[s:e].unsqueeze(1), None)
            for s, e in itertools.pairwise(bounds)
            if e > s
        ]
        return torch.cat(out, 0)

    def _causal(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, _mask: object = None
    ) -> torch.Tensor:
        """Causal attention of `[s, b, heads, dim]` query and `[s, b, groups, dim]` key/value
        through SDPA → `[s, b, heads * dim]` (key/value repeated per query group, as the
        parent does)."""
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, dim]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.config.attention_dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )
        s, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)
