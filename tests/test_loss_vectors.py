"""Spec vectors of docs/loss-spec.md §1–§7: F (corrections), P (PPO core), C (CompIS),
B (AReaL decoupled), S (sequence-level IS), M (M2PO), G (GSPO). §8–§14 are in
test_loss_vectors_more.py."""

from __future__ import annotations

import math

import pytest
import torch

from loss import (
    CompISConfig,
    LossInputs,
    SingleRatioConfig,
    aggregate,
    batch_normalize,
    compis_loss,
    correct,
    decoupled_ppo_loss,
    geometric_mean_ratio,
    gspo_loss,
    m2po_mask,
    ppo_core,
    ppo_surrogate,
    sequence_is_weights,
    single_ratio_loss,
    veto_mask,
)

F64 = torch.float64
ATOL = 1e-6


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def close(a, b, atol=ATOL):
    a = a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=F64)
    torch.testing.assert_close(a.to(F64), t(b).reshape(a.shape), atol=atol, rtol=0)


def bools(s: str) -> torch.Tensor:
    return torch.tensor([c == "1" for c in s])


# ---------------------------------------------------------------- §1 F: per-source corrections

R_F = [1.0, 3.0, 0.25, 1.5]


@pytest.mark.parametrize(
    ("vid", "method", "low", "high", "w", "masked", "clipped"),
    [
        ("F1", "clip", 0.0, 2.0, [1, 2, 0.25, 1.5], "0000", "0100"),
        ("F2", "clip", 0.5, 2.0, [1, 2, 0.5, 1.5], "0000", "0110"),
        ("F3", "cap", 0.0, 2.0, [1, 0, 0.25, 1.5], "0100", "0000"),
        ("F4", "icepop", 0.5, 2.0, [1, 0, 0, 1.5], "0110", "0000"),
        ("F5", "icepop", 0.5, 5.0, [1, 3, 0, 1.5], "0010", "0000"),
    ],
)
def test_F_corrections(vid, method, low, high, w, masked, clipped):
    c = correct(t(R_F), method, low, high)
    close(c.weight, w)
    assert torch.equal(c.masked, bools(masked)), vid
    assert torch.equal(c.clipped, bools(clipped)), vid
    assert not c.weight.requires_grad


def test_F6_boundaries_are_inclusive():
    r = t([2.0, 0.5])
    assert torch.equal(correct(r, "cap", 0.0, 2.0).weight, r)
    assert torch.equal(correct(r, "icepop", 0.5, 2.0).weight, r)
    c = correct(r, "clip", 0.5, 2.0)
    assert torch.equal(c.weight, r) and not c.clipped.any()


def test_F_none_is_raw_weight():
    c = correct(t(R_F), "none")
    close(c.weight, R_F)
    assert not c.masked.any() and not c.clipped.any()


# ---------------------------------------------------------------- §2 P: PPO core


def _ppo(adv, rho, eps_high=0.2, c=None):
    lp_k = torch.zeros(len(rho), dtype=F64)
    lp = torch.log(t(rho)).requires_grad_(True)
    terms = ppo_core(lp, lp_k, t(adv), 0.2, eps_high, c)
    return lp, terms


def test_P1_ppo_clip_and_gradient():
    lp, terms = _ppo([1, 1, -1, -1], [1.5, 0.5, 1.5, 0.5])
    close(terms.loss, [-1.2, -0.5, 1.5, 0.8])
    loss = aggregate(terms.loss, torch.ones(4, dtype=torch.bool), "token-mean")
    close(loss, 0.15)
    assert terms.clipped.double().mean().item() == pytest.approx(0.5)
    loss.backward()
    close(lp.grad, [0, -0.125, 0.375, 0])


def test_P2_dapo_clip_higher():
    per_tok, clipped = ppo_surrogate(
        torch.log(t([1.5, 0.5, 1.5, 0.5])), torch.zeros(4, dtype=F64), t([1, 1, -1, -1]), 0.2, 0.28
    )
    close(per_tok, [-1.28, -0.5, 1.5, 0.8])
    close(per_tok.mean(), 0.13)
    assert clipped.double().mean().item() == pytest.approx(0.5)


def test_P3_dual_clip():
    _, terms = _ppo([-1, -1], [4, 2], c=3.0)
    close(terms.loss, [3, 2])
    close(terms.loss.mean(), 2.5)
    assert terms.dual_clipped.double().mean().item() == pytest.approx(0.5)


def test_P4_zero_advantage():
    _, terms = _ppo([0, 0], [5, 0.1])
    close(terms.loss, [0, 0])
    assert not terms.clipped.any()


# ---------------------------------------------------------------- §3 C: CompIS

P_JS = [0.5, 0.1, 0.8, 0.4]
P_JM = [0.5, 0.3, 0.2, 0.6]
P_K = [0.5, 0.3, 0.6, 0.24]
P_TH = [0.5, 0.33, 0.3, 0.24]
A_C = [1.0, 1.0, -1.0, 1.0]


def ln(p):
    return torch.log(t([p]))


def c_inputs(behavior=True, mask=None):
    lp = ln(P_TH).requires_grad_(True)
    inputs = LossInputs(
        logprobs=lp,
        proximal_logprobs=ln(P_K),
        rollout_logprobs=ln(P_JS),
        behavior_logprobs=ln(P_JM) if behavior else None,
        advantages=t([A_C]),
        loss_mask=torch.ones(1, 4, dtype=torch.bool) if mask is None else mask,
    )
    return lp, inputs


def cfg(f2, f3, **kw):
    return CompISConfig(
        engine_method=f2[0],
        engine_low=f2[1],
        engine_high=f2[2],
        staleness_method=f3[0],
        staleness_low=f3[1],
        staleness_high=f3[2],
        **kw,
    )


NONE = ("none", 0.0, 2.0)


@pytest.mark.parametrize(
    ("vid", "f2", "f3", "w", "keep", "drop"),
    [
        ("C1", NONE, NONE, [1, 3, 0.75, 0.6], -1.075, -1.075),
        ("C2", ("cap", 0.0, 2.0), ("clip", 0.5, 2.0), [1, 0, 0.5, 0.75], -0.3375, -0.45),
        ("C3", ("icepop", 0.5, 2.0), ("icepop", 0.5, 2.0), [1, 0, 0, 0], -0.25, -1.0),
        ("C4", ("clip", 0.0, 2.0), NONE, [1, 2, 0.75, 0.6], -0.8, -0.8),
    ],
)
def test_C_compis(vid, f2, f3, w, keep, drop):
    from loss import compis_terms

    _, inputs = c_inputs()
    close(compis_terms(inputs, cfg(f2, f3)).weight, [w])
    assert compis_loss(inputs, cfg(f2, f3, denom="keep")).loss.item() == pytest.approx(
        keep, abs=ATOL
    ), vid
    assert compis_loss(inputs, cfg(f2, f3, denom="drop")).loss.item() == pytest.approx(
        drop, abs=ATOL
    ), vid


def test_C_derived_ratios_in_metrics():
    _, inputs = c_inputs()
    m = compis_loss(inputs, cfg(NONE, NONE)).metrics
    # r1 = [1, 1.1, 0.5, 1]; r2 = [1, 3, 0.25, 1.5]; r3 = [1, 1, 3, 0.4]; r2·r3 = [1, 3, 0.75, 0.6]
    assert m["is/drift/mean"] == pytest.approx(0.9)
    assert m["is/engine/mean"] == pytest.approx(1.4375)
    assert m["is/staleness/mean"] == pytest.approx(1.35)
    assert m["is/combined/mean"] == pytest.approx(1.3375)
    c2 = compis_loss(inputs, cfg(("cap", 0.0, 2.0), ("clip", 0.5, 2.0))).metrics
    assert c2["is/engine/weight_mean"] == pytest.approx(
        (1 + 0 + 0.25 + 1.5) / 4
    )  # w2 = [1, 0, .25, 1.5]
    assert c2["is/staleness/weight_mean"] == pytest.approx(
        (1 + 1 + 2 + 0.5) / 4
    )  # w3 = [1, 1, 2, .5]
    assert c2["is/weight/mean"] == pytest.approx((1 + 0 + 0.5 + 0.75) / 4)
    assert c2["is/engine/masked_frac"] == 0.25 and c2["is/staleness/clipped_frac"] == 0.5
    assert m["is/drift/clipped_frac"] == pytest.approx(0.25)  # token 3: 0.5 < 0.8 with A < 0
    assert m["loss/compis_fallback"] == 0.0


def test_C2_gradient_reaches_only_current_logprobs():
    lp, inputs = c_inputs()
    for name in ("proximal_logprobs", "rollout_logprobs", "behavior_logprobs"):
        getattr(inputs, name).requires_grad_(False)
    out = compis_loss(inputs, cfg(("cap", 0.0, 2.0), ("clip", 0.5, 2.0)))
    out.loss.backward()
    close(lp.grad, [[-0.25, 0, 0, -0.1875]])
    # the other log-probs enter the graph only as constants
    leaves = [inputs.proximal_logprobs, inputs.rollout_logprobs, inputs.behavior_logprobs]
    proxies = [x.clone().requires_grad_(True) for x in leaves]
    lp2 = ln(P_TH).requires_grad_(True)
    base = dict(advantages=t([A_C]), loss_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="no_grad"):
        LossInputs(logprobs=lp2, proximal_logprobs=proxies[0], rollout_logprobs=leaves[1], **base)


# ---------------------------------------------------------------- §4 B: AReaL decoupled baseline


def test_B1_to_B4_decoupled_single_ratio():
    _, inputs = c_inputs(behavior=False)
    out = decoupled_ppo_loss(inputs, cap=5.0)
    assert out.loss.item() == pytest.approx(-1.075, abs=ATOL)
    assert out.metrics["loss/compis_fallback"] == 1.0
    assert decoupled_ppo_loss(inputs, cap=2.0).loss.item() == pytest.approx(-0.25, abs=ATOL)
    assert decoupled_ppo_loss(inputs, cap=2.0, action="clamp").loss.item() == pytest.approx(
        -0.8, abs=ATOL
    )
    b4 = decoupled_ppo_loss(inputs, action=None, eps_clip_high=0.28)
    assert b4.loss.item() == pytest.approx(-0.575, abs=ATOL)


def test_B_compis_fallback_equals_areal_with_cap_on_f3():
    _, with_b = c_inputs(behavior=True)
    _, without = c_inputs(behavior=False)
    c = cfg(("clip", 0.0, 2.0), ("cap", 0.0, 2.0))
    out = compis_loss(without, c)
    assert out.loss.item() == pytest.approx(-0.25, abs=ATOL)  # = B2
    assert out.metrics["loss/compis_fallback"] == 1.0
    assert "is/engine/mean" not in out.metrics and "is/combined/mean" in out.metrics
    assert compis_loss(with_b, c).metrics["loss/compis_fallback"] == 0.0


# ---------------------------------------------------------------- §5 S: sequence-level IS


def test_S1_S2_sequence_tis_mis():
    d = torch.log(t([R_F]))
    mask = torch.ones(1, 4, dtype=torch.bool)
    close(sequence_is_weights(d, mask, method="clip", low=0.0, high=2.0), [[1.125] * 4])
    close(sequence_is_weights(d, mask, method="cap", high=1.1), [[0.0] * 4])


def test_S3_geometric_mean():
    d = torch.log(t([R_F]))
    close(geometric_mean_ratio(d, torch.ones(1, 4, dtype=torch.bool)), [1.125**0.25])
    assert pytest.approx(1.029884, abs=1e-6) == 1.125**0.25


def test_S4_veto_drops_whole_sequence():
    d = torch.log(t([[*R_F, 5e-5], [1.0, 1.0, 1.0, 1.0, 1.0]]))
    keep = veto_mask(d, torch.ones(2, 5, dtype=torch.bool), threshold=1e-4)
    assert not keep[0].any() and keep[1].all()


def test_S5_token_tis_batch_normalised():
    w = correct(t(R_F), "clip", 0.0, 2.0).weight
    out = batch_normalize(w, torch.ones(4, dtype=torch.bool))
    close(out, [0.842105, 1.684211, 0.210526, 1.263158])


def test_S_single_ratio_loss_token_tis_equals_C4_decoupled():
    _, inputs = c_inputs(behavior=False)
    out = single_ratio_loss(inputs, SingleRatioConfig(level="token", method="clip", high=2.0))
    assert out.loss.item() == pytest.approx(-0.8, abs=ATOL)


# ---------------------------------------------------------------- §6 M: M2PO

DELTA_M = [0.5, 0.1, -0.1, 0.0, 0.3]


@pytest.mark.parametrize(
    ("vid", "delta", "tau", "keep"),
    [
        ("M1", DELTA_M, 0.04, "01111"),
        ("M2", DELTA_M, 0.02, "01110"),
        ("M3", DELTA_M, 0.5, "11111"),
        ("M4", [1.0, 1.0, 1.0], 0.04, "001"),
    ],
)
def test_M_m2po_mask(vid, delta, tau, keep):
    got = m2po_mask(t(delta), torch.ones(len(delta), dtype=torch.bool), tau=tau)
    assert torch.equal(got, bools(keep)), vid


# ---------------------------------------------------------------- §7 G: GSPO


def _gspo_inputs(log_ratios, adv):
    lp = t(log_ratios).requires_grad_(True)
    return lp, LossInputs(
        logprobs=lp,
        proximal_logprobs=torch.zeros(2, 2, dtype=F64),
        rollout_logprobs=torch.zeros(2, 2, dtype=F64),
        advantages=t(adv),
        loss_mask=torch.ones(2, 2, dtype=torch.bool),
    )


def test_G1_G2_gspo_value_and_gradient():
    l2 = math.log(2.0)
    lp, inputs = _gspo_inputs([[l2, 0.0], [l2, 0.0]], [[1.0, 1.0], [-1.0, -1.0]])
    out = gspo_loss(inputs)
    assert out.loss.item() == pytest.approx(0.206907, abs=ATOL)
    assert out.metrics["is/gspo_seq/mean"] == pytest.approx(math.sqrt(2.0), abs=ATOL)
    out.loss.backward()
    close(lp.grad, [[0.0, 0.0], [0.353553, 0.353553]])


def test_G3_gspo_on_policy_is_zero():
    _, inputs = _gspo_inputs([[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [-1.0, -1.0]])
    assert gspo_loss(inputs).loss.item() == pytest.approx(0.0, abs=ATOL)
