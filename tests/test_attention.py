"""Packed attention through `scaled_dot_product_attention` (`slime_async/trainer/attention.py`)
against megatron's own local attention math, sample by sample (grouped-query heads, fp32)."""

from __future__ import annotations

import itertools

import pytest
import torch

from slime_async.contracts.model import ModelSpec

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

SPEC = ModelSpec(family="llama", num_layers=1)  # 4 query heads over 2 key/value groups
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-6 if DEVICE == "cpu" else 1e-5  # GPU kernels accumulate fp32 in other orders


def _layers():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from slime_async.trainer import parallel
    from slime_async.trainer.attention import PackedDotProductAttention
    from slime_async.trainer.model import transformer_config

    parallel.init_distributed(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=parallel.free_port()
    )
    layout = parallel.resolve_layout(world_size=1, tp=1, ep=1, pp=1)
    parallel.init_model_parallel(layout, seed=0)
    cfg = transformer_config(SPEC, layout)
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return PackedDotProductAttention(cfg, **kw), DotProductAttention(cfg, **kw)


def _qkv(t: int, b: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h, kv, d = SPEC.num_attention_heads, SPEC.num_key_value_heads, SPEC.head_dim
    return (
        torch.randn(t, b, h, d, generator=g).to(DEVICE),
        torch.randn(t, b, kv, d, generator=g).to(DEVICE),
        torch.randn(t, b, kv, d, generator=g).to(DEVICE),
    )


def _causal_mask(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=DEVICE), diagonal=1)


def test_sdpa_packed_and_padded_equal_megatrons_attention_per_sample():
    from megatron.core.packed_seq_params import PackedSeqParams

    ours, theirs = _layers()
    bounds = [0, 5, 6, 13, 20]
    q, k, v = _qkv(20)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7
    )
    got = ours(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=packed)
    for s, e in itertools.pairwise(bounds):
        want = theirs(q[s:e], k[s:e], v[s:e], _causal_mask(e - s))
        assert torch.allclose(got[s:e], want, atol=TOL, rtol=1e-5), (s, e)
    q, k, v = _qkv(9, b=3, seed=1)  # padded BSHD: causal over the whole row
    want = theirs(q, k, v, _causal_mask(9))
    assert torch.allclose(ours(q, k, v, None), want, atol=TOL, rtol=1e-5)
