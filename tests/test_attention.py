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


def _packed(bounds: list[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    n = max(e - s for s, e in itertools.pairwise(bounds))
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n
    )


def _attend(layer, batched: bool, q, k, v, packed):
    """Output and q/k/v gradients of one packed call, batched or one SDPA call per sample."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    layer.batched = batched
    try:
        out = layer(q, k, v, None, packed_seq_params=packed)
    finally:
        layer.batched = True
    g = torch.Generator().manual_seed(7)
    out.backward(torch.randn(out.shape, generator=g).to(DEVICE))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("budget", [None, 400])
def test_batched_packed_attention_equals_one_call_per_sample(monkeypatch, budget):
    """Packed samples attended in padded groups (grouped-query heads, fp32) give each sample's
    per-sample SDPA output to 1e-6 and q/k/v gradients to 1e-6 of their largest entry (the
    batched backward sums in another order); with a small score budget the samples
    split into several groups and the longest runs alone (SDPA), the same numbers."""
    from slime_async.trainer import attention

    if budget is not None:
        monkeypatch.setattr(attention, "SCORE_ELEMENTS", budget)
        monkeypatch.setattr(attention, "GROUP_ELEMENTS", budget)
    attention.padded_groups.cache_clear()
    ours, _ = _layers()
    bounds = [0, 5, 6, 13, 20, 29, 31, 42]
    plan = attention.padded_groups(tuple(bounds), SPEC.num_attention_heads, torch.device(DEVICE))
    if budget is None:
        # lengths 11, 9, 7, 7 | 5 | 2, 1: each at least half its group's longest
        assert [g.samples for g in plan.groups] == [4, 1, 2] and not plan.alone
    else:
        assert plan.alone == ((31, 42),) and [g.samples for g in plan.groups] == [1, 2, 1, 2]
    q, k, v = (x[:, 0] for x in _qkv(42, seed=2))
    batched = _attend(ours, True, q, k, v, _packed(bounds))
    per_sample = _attend(ours, False, q, k, v, _packed(bounds))
    for name, a, b in zip(("out", "dq", "dk", "dv"), batched, per_sample, strict=True):
        assert a.shape == b.shape, name
        scale = 1.0 if name == "out" else max(1.0, float(b.abs().max()))
        assert (a - b).abs().max() <= TOL * scale, (name, (a - b).abs().max(), scale)
    attention.padded_groups.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_groups_padded_with_a_real_row_are_bitwise_those_padded_with_zeros(dtype):
    """A group is gathered in one pass, each sample's padding repeating its own last row (large
    values here); the output and the q/k/v gradients are bitwise those of the same groups
    zero-padded and attended through `causal_attention` (autograd unpads the gradients). And,
    as with zeros, nothing of one sample reaches another: a NaN in one sample's last row
    leaves every other sample's output and gradients as they were."""
    from slime_async.trainer import attention

    bounds = (0, 5, 6, 13, 20, 29, 31, 42)
    heads, groups = SPEC.num_attention_heads, SPEC.num_key_value_heads
    plan = attention.padded_groups(bounds, heads, torch.device(DEVICE))
    assert any(g.pad.numel() for g in plan.groups)
    q, k, v = (x[:, 0].to(dtype) for x in _qkv(42, seed=3))
    last = [e - 1 for e in bounds[1:]]
    for x in (q, k, v):
        x[last] *= 1e4  # the rows the padding repeats: any leak shows
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    scale = SPEC.head_dim**-0.5

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(g)
        return out.detach(), *(x.grad for x in leaves)

    def zero_padded(q, k, v):
        out = q.new_zeros(q.shape)
        for grp in plan.groups:
            src = torch.cat([torch.arange(s, s + n) for s, n in grp.spans])
            dst = torch.cat([torch.arange(b * grp.width, b * grp.width + n)
                             for b, (_, n) in enumerate(grp.spans)])  # fmt: skip
            pad = [
                x.new_zeros(grp.samples * grp.width, *x.shape[1:])
                .index_copy(0, dst, x.index_select(0, src))
                .view(grp.samples, grp.width, *x.shape[1:])
                for x in (q, k, v)
            ]
            o = attention.causal_attention(*pad, scale).reshape(-1, heads, q.shape[-1])
            out = out.index_copy(0, src, o.index_select(0, dst))
        return out

    ours = run(lambda q, k, v: attention._PackedGroups.apply(q, k, v, plan, scale))
    ref = run(zero_padded)
    assert k.shape[1] == groups
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max())

    v[12] = float("nan")  # the last row of the sample [6, 13), which has padding
    poisoned = run(lambda q, k, v: attention._PackedGroups.apply(q, k, v, plan, scale))
    other = torch.ones(42, dtype=torch.bool)
    other[6:13] = False
    for a, b in zip(poisoned, ours, strict=True):
        assert torch.equal(a[other], b[other])


def test_a_gpu_groups_more_samples_than_a_cpu():
    """A CPU's groups keep their scores within a core's cache (`GROUP_ELEMENTS`); a GPU's
    within the per-sample budget (`SCORE_ELEMENTS`): the recipe's 32 samples of 60-100 tokens
    take eight times fewer kernels there."""
    from slime_async.trainer import attention

    assert attention.group_budget("cpu") == attention.GROUP_ELEMENTS
    assert attention.group_budget(torch.device("cuda", 0)) == attention.SCORE_ELEMENTS
    assert attention.GROUP_ELEMENTS < attention.SCORE_ELEMENTS
    bounds = [0]
    for i in range(32):
        bounds.append(bounds[-1] + 60 + (i * 13) % 41)
    plan = attention.padded_groups(tuple(bounds), 9, torch.device("cpu"))
    assert all(g.samples * 9 * g.width**2 <= attention.GROUP_ELEMENTS for g in plan.groups)
    assert sum(g.samples for g in plan.groups) == 32 and len(plan.groups) > 4


def test_batched_attention_gives_the_models_logprobs_of_one_call_per_sample():
    """The trainer's log-probs and entropies (fp32, a dense 2-layer model, ragged packed
    samples in one micro-batch) are those of one attention call per sample, to 1e-6 (plus
    1e-6 relative)."""
    from slime_async.trainer.attention import PackedDotProductAttention
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    spec = ModelSpec(family="llama", num_layers=2)
    lengths = [9, 23, 5, 17, 30, 12, 2, 26]
    b = random_batch(spec, batch=len(lengths), width=30, prompt=1, seed=4, lengths=lengths)
    tr = MegatronTrainer(TrainerConfig(lr=1e-4, seed=0), spec)
    try:
        lp, ent = tr.compute_logprobs(b)
        PackedDotProductAttention.batched = False
        lp_ref, ent_ref = tr.compute_logprobs(b)
    finally:
        PackedDotProductAttention.batched = True
        tr.shutdown()
    # 1e-6 absolute plus 1e-6 relative: entropies near 8 move by a few fp32 ulps (~1e-6 each)
    assert torch.allclose(lp, lp_ref, atol=1e-6, rtol=1e-6)
    assert torch.allclose(ent, ent_ref, atol=1e-6, rtol=1e-6)
    assert lp[0, 1:9].abs().min() > 0  # real log-probs were compared
