"""Properties of the loss package beyond the spec vectors: gradient routing, micro-batch and
DP-split invariance, packed == padded, NaN safety, bf16 upcast, the fused weight path against
the reference `correct`, large-batch diagnostics, and clear errors for bad configs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loss import (
    CompISConfig,
    LossInputs,
    Method,
    compis_denominators,
    compis_loss,
    compis_terms,
    correct,
    correct_log,
    decoupled_ppo_loss,
    safe_log_ratio,
)

torch.set_num_threads(1)
F64 = torch.float64
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def random_batch(b=6, t=12, *, seed=0, dtype=F64, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    lp_s = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    lp_m = lp_s + torch.randn(b, t, generator=g, dtype=dtype) * spread
    lp_k = lp_m + torch.randn(b, t, generator=g, dtype=dtype) * spread
    lp_t = lp_k + torch.randn(b, t, generator=g, dtype=dtype) * 0.15
    adv = torch.randn(b, 1, generator=g, dtype=dtype).expand(b, t).clone()
    lengths = torch.randint(1, t + 1, (b, 1), generator=g)
    lengths[-1] = 0  # one fully masked sequence
    mask = torch.arange(t).unsqueeze(0) < lengths
    return dict(lp_t=lp_t, lp_k=lp_k, lp_m=lp_m, lp_s=lp_s, adv=adv, mask=mask)


def make_inputs(x, rows=slice(None), *, behavior=True, **kw):
    lp = x["lp_t"][rows].clone().requires_grad_(True)
    return lp, LossInputs(
        logprobs=lp,
        proximal_logprobs=x["lp_k"][rows],
        rollout_logprobs=x["lp_s"][rows],
        behavior_logprobs=x["lp_m"][rows] if behavior else None,
        advantages=x["adv"][rows],
        loss_mask=x["mask"][rows],
        **kw,
    )


def cfg_for(mode, denom, **kw):
    return CompISConfig(
        engine_method="icepop",
        engine_low=0.5,
        engine_high=2.0,
        staleness_method="cap",
        staleness_high=2.0,
        agg_mode=mode,
        denom=denom,
        loss_scale_factor=12.0 if mode == "seq-mean-token-sum-norm" else None,
        diagnostics=False,
        **kw,
    )


# ------------------------------------------------------------------ gradient routing


def test_gradient_reaches_only_current_logprobs():
    x = random_batch()
    lp, inputs = make_inputs(x)
    leaves = {n: getattr(inputs, n).clone().requires_grad_(True) for n in ("advantages",)}
    inputs = dataclasses.replace(inputs, advantages=leaves["advantages"])
    terms = compis_terms(inputs, cfg_for("token-mean", "keep"))
    assert not terms.weight.requires_grad and not terms.mask.requires_grad
    out = compis_loss(inputs, cfg_for("token-mean", "keep"))
    out.loss.backward()
    assert lp.grad is not None and lp.grad.abs().sum() > 0
    assert leaves["advantages"].grad is None  # advantages are constants
    assert torch.equal(lp.grad[~x["mask"]], torch.zeros_like(lp.grad[~x["mask"]]))


# ------------------------------------------------------------------ micro-batch / DP invariance


@pytest.mark.parametrize("denom", ["keep", "drop"])
@pytest.mark.parametrize("mode", MODES)
def test_microbatch_and_dp_split_match_full_batch(mode, denom):
    x = random_batch(b=8, seed=1)
    cfg = cfg_for(mode, denom)
    lp_full, full = make_inputs(x)
    loss_full = compis_loss(full, cfg).loss
    loss_full.backward()
    # two DP ranks, two micro-batches each, uneven sizes; denominators all-reduced (summed)
    splits = [slice(0, 1), slice(1, 4), slice(4, 6), slice(6, 8)]
    parts = [compis_denominators(make_inputs(x, s)[1], cfg) for s in splits]
    g_tok, g_seq = sum(p[0] for p in parts), sum(p[1] for p in parts)
    assert (g_tok, g_seq) == compis_denominators(full, cfg)
    total = 0.0
    grads = []
    for s in splits:
        lp, inputs = make_inputs(x, s, global_num_tokens=g_tok, global_num_seqs=g_seq)
        loss = compis_loss(inputs, cfg).loss
        loss.backward()
        total += loss.item()
        grads.append(lp.grad)
    assert total == pytest.approx(loss_full.item(), abs=1e-12)
    torch.testing.assert_close(torch.cat(grads), lp_full.grad, atol=1e-12, rtol=0)


def test_local_denominators_are_not_invariant():
    """Without global denominators, averaging micro-batch losses is biased (why they exist)."""
    x = random_batch(b=8, seed=2)
    cfg = cfg_for("token-mean", "keep")
    full = compis_loss(make_inputs(x)[1], cfg).loss.item()
    parts = [compis_loss(make_inputs(x, s)[1], cfg).loss.item() for s in (slice(0, 1), slice(1, 8))]
    assert abs(sum(parts) / 2 - full) > 1e-3


# ------------------------------------------------------------------ packed == padded


def pack(x, *, trailing_pad=3):
    """Padded [B, T] → packed [N] keeping each row's first `len_i + 2` positions (so masked
    positions exist inside packed sequences too) and trailing unused slots."""
    lens = (x["mask"].sum(1) + 2).clamp(max=x["mask"].shape[1]).tolist()
    out = {k: torch.cat([v[i, : lens[i]] for i in range(len(lens))]) for k, v in x.items()}
    for k, v in out.items():  # trailing slots past cu_seqlens[-1]
        fill = (
            torch.zeros(trailing_pad, dtype=v.dtype)
            if k == "mask"
            else torch.full((trailing_pad,), -math.inf if k != "adv" else math.nan, dtype=v.dtype)
        )
        out[k] = torch.cat([v, fill])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return out, cu, lens


@pytest.mark.parametrize("mode", MODES)
def test_packed_equals_padded(mode):
    x = random_batch(b=5, seed=3)
    cfg = dataclasses.replace(cfg_for(mode, "drop"), diagnostics=True)
    lp_pad, padded = make_inputs(x)
    out_pad = compis_loss(padded, cfg)
    out_pad.loss.backward()
    px, cu, lens = pack(x)
    lp_pk, packed = make_inputs(px, cu_seqlens=cu)
    out_pk = compis_loss(packed, cfg)
    out_pk.loss.backward()
    assert out_pk.loss.item() == pytest.approx(out_pad.loss.item(), abs=1e-12)
    grads = torch.cat([lp_pad.grad[i, : lens[i]] for i in range(len(lens))])
    torch.testing.assert_close(lp_pk.grad[: int(cu[-1])], grads, atol=1e-12, rtol=0)
    assert torch.equal(lp_pk.grad[int(cu[-1]) :], torch.zeros(3, dtype=F64))
    for k, v in out_pad.metrics.items():
        assert out_pk.metrics[k] == pytest.approx(v, abs=1e-9, nan_ok=True), k


# ------------------------------------------------------------------ NaN safety, bf16


def test_no_nan_with_minus_inf_padding_everywhere():
    x = random_batch(seed=4)
    for k in ("lp_t", "lp_k", "lp_m", "lp_s"):
        x[k] = torch.where(x["mask"], x[k], -math.inf)
    x["adv"] = torch.where(x["mask"], x["adv"], math.nan)
    for mode in MODES:
        lp, inputs = make_inputs(x)
        out = compis_loss(inputs, dataclasses.replace(cfg_for(mode, "drop"), diagnostics=True))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert torch.isfinite(lp.grad).all()
        assert torch.equal(lp.grad[~x["mask"]], torch.zeros_like(lp.grad[~x["mask"]]))
        bad = [k for k, v in out.metrics.items() if not math.isfinite(v)]
        assert not bad, bad


def test_bf16_inputs_are_upcast_before_subtracting():
    x = random_batch(seed=5, dtype=torch.float32)
    for k in ("lp_t", "lp_k", "lp_m", "lp_s"):
        x[k] = (x[k] - 5.0).to(torch.bfloat16)
    cfg = cfg_for("token-mean", "keep")
    lp16, in16 = make_inputs(x)
    out16 = compis_loss(in16, cfg)
    out16.loss.backward()
    x32 = {k: (v.float() if v.is_floating_point() else v) for k, v in x.items()}
    lp32, in32 = make_inputs(x32)
    out32 = compis_loss(in32, cfg)
    out32.loss.backward()
    assert out16.loss.dtype == torch.float32
    assert out16.loss.item() == out32.loss.item()
    assert lp16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp16.grad.float(), lp32.grad.to(torch.bfloat16).float())
    # subtracting in bf16 rounds the difference of log-probs of different magnitude
    a, b = (
        torch.tensor([-5.03125], dtype=torch.bfloat16),
        torch.tensor([-0.0107], dtype=torch.bfloat16),
    )
    exact = a.double() - b.double()
    assert abs(float(safe_log_ratio(a, b)) - float(exact)) < 1e-6
    assert abs(float((a - b).double()) - float(exact)) > 1e-3


# ------------------------------------------------------------------ fused path == reference


def reference_weight(x, cfg):
    """w = f2(r2)·f3(r3) built from `correct` on ratio tensors (the spec's definition)."""
    r2 = torch.exp((x["lp_m"] - x["lp_s"]).clamp(-20, 20))
    r3 = torch.exp((x["lp_k"] - x["lp_m"]).clamp(-20, 20))
    w2 = correct(r2, cfg.engine_method, cfg.engine_low, cfg.engine_high).weight
    w3 = correct(r3, cfg.staleness_method, cfg.staleness_low, cfg.staleness_high).weight
    return torch.where(x["mask"], w2 * w3, 0.0)


@pytest.mark.parametrize("m2", list(Method))
@pytest.mark.parametrize("m3", list(Method))
def test_fused_weights_match_reference_corrections(m2, m3):
    x = random_batch(b=16, t=32, seed=6, spread=0.8)
    cfg = CompISConfig(
        engine_method=m2,
        engine_low=0.5,
        engine_high=2.0,
        staleness_method=m3,
        staleness_low=0.4,
        staleness_high=1.8,
    )
    w = compis_terms(make_inputs(x)[1], cfg).weight
    torch.testing.assert_close(w, reference_weight(x, cfg), atol=1e-12, rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-8, 8, allow_nan=False), min_size=1, max_size=20),
    st.sampled_from(list(Method)),
    st.floats(0.05, 0.95),
    st.floats(1.05, 6.0),
)
def test_correct_log_agrees_with_correct(logs, method, low, high):
    d = torch.tensor(logs, dtype=F64)
    ref = correct(d.exp(), method, low, high)
    logw, masked, clipped = correct_log(d, method, low, high)
    torch.testing.assert_close(logw.exp(), ref.weight, atol=1e-12, rtol=1e-12)
    if masked is not None:
        assert torch.equal(masked, ref.masked)
    if clipped is not None:
        assert torch.equal(clipped, ref.clipped)


# ------------------------------------------------------------------ diagnostics at scale


def test_diagnostics_on_large_batch_are_sampled_and_accurate():
    x = random_batch(b=256, t=1024, seed=7, dtype=torch.float32, spread=0.1)  # 262k tokens
    cfg = dataclasses.replace(cfg_for("token-mean", "keep"), diagnostics=True)
    _, inputs = make_inputs(x, token_versions=torch.full((256, 1024), 7), current_version=9)
    m = compis_loss(inputs, cfg).metrics
    assert m["diag/sample_tokens"] < x["mask"].sum().item()
    r2 = (x["lp_m"] - x["lp_s"]).exp()[x["mask"]].double()
    assert m["is/engine/mean"] == pytest.approx(r2.mean().item(), rel=5e-3)
    assert m["is/engine/p90"] == pytest.approx(r2.quantile(0.9).item(), rel=5e-3)
    assert m["is/staleness/version_lag_mean"] == 2.0
    assert m["loss/num_tokens"] == x["mask"].sum().item()
    assert all(math.isfinite(v) for v in m.values())


def test_diagnostics_off_reports_loss_only():
    _, inputs = make_inputs(random_batch(seed=8))
    m = compis_loss(inputs, cfg_for("token-mean", "keep")).metrics
    assert set(m) == {"loss/value", "loss/compis_fallback"}


# ------------------------------------------------------------------ bad configs and inputs


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(engine_method="clip", engine_low=2.0, engine_high=2.0), "low < high"),
        (dict(staleness_method="icepop", staleness_low=3.0, staleness_high=2.0), "low < high"),
        (dict(engine_method="tis"), "engine_method='tis' is not supported"),
        (dict(staleness_method="cap", staleness_high=0.0), "staleness_high=0.0 must be"),
        (dict(staleness_method="cap", staleness_high=-1.0), "must be a finite number > 0"),
        (dict(engine_low=-0.1), "engine_low=-0.1"),
        (dict(eps_clip=0.0), "eps_clip=0.0"),
        (dict(eps_clip_high=-0.1), "eps_clip_high"),
        (dict(dual_clip_c=1.0), "dual_clip_c=1.0 must be > 1"),
        (dict(agg_mode="seq-mean"), "agg_mode='seq-mean' is not supported"),
        (dict(agg_mode="seq-mean-token-sum-norm"), "needs loss_scale_factor"),
        (dict(denom="maybe"), "denom='maybe'"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
    ],
)
def test_bad_configs_raise_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        CompISConfig(**kw)


def test_bad_inputs_raise_clear_errors():
    x = random_batch()
    _, good = make_inputs(x)
    with pytest.raises(ValueError, match="same shape"):
        dataclasses.replace(good, advantages=x["adv"][:, :3])
    with pytest.raises(ValueError, match="bool"):
        dataclasses.replace(good, loss_mask=x["mask"].float())
    with pytest.raises(ValueError, match="no_grad"):
        dataclasses.replace(good, proximal_logprobs=x["lp_k"].clone().requires_grad_(True))
    with pytest.raises(ValueError, match="packed 1-D"):
        dataclasses.replace(good, cu_seqlens=torch.tensor([0, 12]))
    flat = {k: v.reshape(-1) for k, v in x.items()}
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        make_inputs(flat, cu_seqlens=torch.tensor([1, 5]))
    with pytest.raises(ValueError, match="non-decreasing"):
        from loss.ratios import segment_ids

        segment_ids(torch.tensor([0, 5, 3]), 8)
    with pytest.raises(ValueError, match=r"cap=1.0 must be > 1"):
        decoupled_ppo_loss(good, cap=1.0)
    with pytest.raises(ValueError, match="correction_high"):
        correct(torch.ones(3), "cap", 0.0, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("method", ["cap", "icepop"])
def test_fused_masks_are_exact_at_the_bounds(dtype, method):
    """u = 1, l = 2^-2: log-ratios exactly on a bound are kept, a hair past it are zeroed."""
    tiny = 2.0**-40
    d3 = torch.tensor([[0.0, tiny, math.log(0.25), -1.3862943611198906 - 1e-6]], dtype=dtype)
    zeros = torch.zeros_like(d3)
    inputs = LossInputs(
        logprobs=zeros.clone(),
        proximal_logprobs=d3,
        rollout_logprobs=zeros,
        behavior_logprobs=zeros,
        advantages=torch.ones_like(d3),
        loss_mask=torch.ones(d3.shape, dtype=torch.bool),
    )
    cfg = CompISConfig(
        engine_method="none", staleness_method=method, staleness_low=0.25, staleness_high=1.0
    )
    w = compis_terms(inputs, cfg).weight[0]
    assert w[0].item() == 1.0 and w[1].item() == 0.0
    if method == "icepop":
        assert w[2].item() == pytest.approx(0.25) and w[3].item() == 0.0
    else:
        assert w[2].item() == pytest.approx(0.25) and w[3].item() > 0.0


def test_packed_padding_past_cu_seqlens_must_be_masked():
    flat = {k: v.reshape(-1) for k, v in random_batch().items()}
    flat["mask"] = torch.ones_like(flat["mask"])
    with pytest.raises(ValueError, match="past cu_seqlens"):
        make_inputs(flat, cu_seqlens=torch.tensor([0, 10, 20]))


@pytest.mark.parametrize("name", ["gspo", "seq_tis", "geo_veto", "prime", "m2po"])
def test_baselines_packed_equal_padded(name):
    from loss import (
        SingleRatioConfig,
        gspo_loss,
        m2po_loss,
        prime_masked_is_loss,
        single_ratio_loss,
    )

    fns = {
        "gspo": gspo_loss,
        "seq_tis": lambda i: single_ratio_loss(i, SingleRatioConfig(level="sequence", high=2.0)),
        "geo_veto": lambda i: single_ratio_loss(
            i,
            SingleRatioConfig(
                method="cap", high=3.0, geo_low=0.5, geo_high=2.0, veto_threshold=0.05
            ),
        ),
        "prime": lambda i: prime_masked_is_loss(i, token_low=0.3, token_high=3.0),
        "m2po": m2po_loss,
    }
    x = random_batch(b=5, seed=9)
    lp_pad, padded = make_inputs(x)
    out_pad = fns[name](padded)
    out_pad.loss.backward()
    px, cu, lens = pack(x)
    lp_pk, packed = make_inputs(px, cu_seqlens=cu)
    out_pk = fns[name](packed)
    out_pk.loss.backward()
    assert torch.isfinite(out_pad.loss) and out_pk.loss.item() == pytest.approx(
        out_pad.loss.item(), abs=1e-12
    )
    grads = torch.cat([lp_pad.grad[i, : lens[i]] for i in range(len(lens))])
    torch.testing.assert_close(lp_pk.grad[: int(cu[-1])], grads, atol=1e-12, rtol=0)


def test_large_batch_weights_and_drop_mask_match_reference():
    x = random_batch(b=3, t=50_000, seed=10, spread=0.8)
    cfg = cfg_for("seq-mean-token-mean", "drop")
    cfg = dataclasses.replace(cfg, staleness_method="clip", staleness_low=0.5)
    t = compis_terms(make_inputs(x)[1], cfg)
    torch.testing.assert_close(t.weight, reference_weight(x, cfg), atol=1e-12, rtol=1e-12)
    keep = (correct((x["lp_m"] - x["lp_s"]).exp(), "icepop", 0.5, 2.0).masked == 0) & x["mask"]
    assert torch.equal(t.mask.bool(), keep)
