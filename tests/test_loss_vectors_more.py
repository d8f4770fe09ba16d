"""Spec vectors of docs/loss-spec.md §8–§14: A (advantages), D (DAPO), L (aggregation),
O (staleness filter), R (prime-rl masked IS), K (diagnostics), N (pitfalls)."""

from __future__ import annotations

import math

import pytest
import torch

from loss import (
    CompISConfig,
    LossInputs,
    SamplingDecision,
    abs_diff_seq_mean,
    aggregate,
    compis_loss,
    dynamic_sampling_decision,
    dynamic_sampling_keep,
    geometric_mean_ratio,
    grpo_advantages,
    kl_estimators,
    max_off_policy_filter,
    outcome_to_token_rewards,
    overlong_penalty,
    prime_masked_is_loss,
    ratio_stats,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    safe_ratio,
)

F64 = torch.float64
ATOL = 1e-6
R_F = [1.0, 3.0, 0.25, 1.5]


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def close(a, b, atol=ATOL):
    a = a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=F64)
    torch.testing.assert_close(a.to(F64), t(b).reshape(a.shape), atol=atol, rtol=0)


# ---------------------------------------------------------------- §8 A: advantages


def test_A1_A2_A4_grpo_and_dr_grpo():
    g = torch.zeros(4, dtype=torch.long)
    close(grpo_advantages(t([1, 0, 0, 0]), g), [1.499997, -0.499999, -0.499999, -0.499999])
    close(grpo_advantages(t([1, 0, 0, 0]), g, std_normalize=False), [0.75, -0.25, -0.25, -0.25])
    close(
        grpo_advantages(t([1, 0, 0, 1]), g), [0.866025, -0.866025, -0.866025, 0.866025], atol=2e-6
    )
    close(grpo_advantages(t([1, 0, 0, 1]), g, std_normalize=False), [0.5, -0.5, -0.5, 0.5])
    close(
        grpo_advantages(t([1, 0]), torch.zeros(2, dtype=torch.long)),
        [0.707106, -0.707106],
        atol=2e-6,
    )


def test_A3_singleton_and_all_equal_groups():
    close(grpo_advantages(t([0.7, 1, 1]), torch.tensor([0, 1, 1])), [0.6999993, 0, 0])


def test_A5_reinforce_pp_global_whitening():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    rewards = outcome_to_token_rewards(t([1.0, 0.0]), mask)
    close(reinforce_pp_advantages(rewards, mask), [[0.5, 0.5, 0.5], [-1.5, 0, 0]])


def test_A6_reinforce_pp_discounted():
    mask = torch.ones(1, 3, dtype=torch.bool)
    r = t([[0.0, 0.0, 1.0]])
    close(reinforce_pp_returns(r, mask, gamma=0.5), [[0.25, 0.5, 1.0]])
    close(reinforce_pp_advantages(r, mask, gamma=0.5), [[-0.872872, -0.218218, 1.091089]])


def test_A6b_reinforce_pp_discount_counts_masked_interior_positions():
    """slime's convention: a masked interior span (tool output of a multi-turn rollout) carries
    no reward, and its positions still count as discount steps: G_t = γ^(s − t)·R by position."""
    mask = torch.tensor([[True, True, False, False, True]])
    r = outcome_to_token_rewards(t([1.0]), mask)
    close(reinforce_pp_returns(r, mask, gamma=0.5), [[0.0625, 0.125, 0.0, 0.0, 1.0]])


def test_A7_reinforce_pp_baseline():
    mask = torch.ones(4, 1, dtype=torch.bool)
    adv = reinforce_pp_baseline_advantages(t([1, 0, 0, 0]), torch.zeros(4, dtype=torch.long), mask)
    close(adv, [[1.5], [-0.5], [-0.5], [-0.5]])


# ---------------------------------------------------------------- §9 D: DAPO extras


def test_D1_overlong_penalty():
    pen = overlong_penalty(torch.tensor([10, 16, 17, 18, 20]), max_len=20, buffer_len=4, factor=1.0)
    close(pen, [0, 0, -0.25, -0.5, -1.0])


def test_D2_D3_dynamic_sampling():
    keep = dynamic_sampling_keep([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1], [0.5]])
    assert keep == [False, False, True, True]
    assert dynamic_sampling_decision(sum(keep), 3, 1, 4) is SamplingDecision.SAMPLE_MORE
    assert dynamic_sampling_decision(sum(keep), 3, 4, 4) is SamplingDecision.GIVE_UP
    assert dynamic_sampling_decision(3, 3, 1, 4) is SamplingDecision.ENOUGH


# ---------------------------------------------------------------- §10 L: aggregation

L1_LOSS = [[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]]
L1_MASK = [[1, 1, 1, 0], [1, 0, 0, 0]]
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@pytest.mark.parametrize(
    ("vid", "loss", "mask", "expected", "h"),
    [
        ("L1", L1_LOSS, L1_MASK, [2.5, 3.0, 5.0, 1.25], 4.0),
        ("L2", [*L1_LOSS, [9.0] * 4], [*L1_MASK, [0] * 4], [2.5, 3.0, 5.0, 1.25], 4.0),
        ("L3", [[1.0, 1.0]], [[1, 1]], [1.0, 1.0, 2.0, 1.0], 2.0),
    ],
)
def test_L_aggregation(vid, loss, mask, expected, h):
    m = t(mask).bool()
    for mode, want in zip(MODES, expected):
        got = aggregate(t(loss), m, mode, loss_scale_factor=h)
        assert got.item() == pytest.approx(want, abs=ATOL), (vid, mode)


# ---------------------------------------------------------------- §11 O: staleness filter


def test_O1_O2_O3_max_off_policy_steps():
    r = max_off_policy_filter(9, [5, 7, 8, 9], 2)
    assert r.keep == [False, True, True, True] and r.staleness == [4, 2, 1, 0]
    assert r.metrics["staleness/evicted"] == 1.0 and r.metrics["staleness/evicted_max"] == 4.0
    assert max_off_policy_filter(9, [5, 7, 8, 9], 0).keep == [False, False, False, True]
    r3 = max_off_policy_filter(9, [[7, 8, 9]], 2)
    assert r3.keep == [True] and r3.staleness == [2]


def test_O_whole_groups_are_evicted():
    r = max_off_policy_filter(9, [8, 5, 9, 9], 2, group_ids=[0, 0, 1, 1])
    assert r.keep == [False, False, True, True]
    assert r.metrics["staleness/evicted_groups"] == 1.0


# ---------------------------------------------------------------- §12 R: prime-rl masked IS


def test_R1_prime_masked_is():
    rho = [1.0, 10.0, 0.1, 1.2]
    lp = torch.log(t([rho])).requires_grad_(True)
    inputs = LossInputs(
        logprobs=lp,
        proximal_logprobs=torch.zeros(1, 4, dtype=F64),
        rollout_logprobs=torch.zeros(1, 4, dtype=F64),
        advantages=torch.ones(1, 4, dtype=F64),
        loss_mask=torch.ones(1, 4, dtype=torch.bool),
    )
    geo = geometric_mean_ratio(lp.detach(), inputs.loss_mask)
    close(geo, [1.046635])
    out = prime_masked_is_loss(inputs)
    assert out.metrics["is/weight/masked_frac"] == pytest.approx(0.5)
    out.loss.backward()
    close(lp.grad, [[-0.25, 0, 0, -0.3]])


# ---------------------------------------------------------------- §13 K: diagnostics


def test_K1_ratio_stats():
    r = t(R_F)
    s = ratio_stats("x", r, torch.log(r), low=0.5, high=2.0)
    expected = {
        "mean": 1.4375,
        "p50": 1.25,
        "p90": 2.55,
        "p99": 2.955,
        "max": 3.0,
        "frac_above_high": 0.25,
        "frac_below_low": 0.25,
        "kl_k1": -0.029446,
        "kl_k2": 0.411645,
        "kl_k3": 0.408054,
        "ess": 0.671320,
        "chi2_token": 2.078125,
    }
    for k, v in expected.items():
        assert float(s[f"x/{k}"]) == pytest.approx(v, abs=ATOL), k


def test_K2_kl_estimators():
    k1, k2, k3 = kl_estimators(torch.log(t([2.0, 0.5])))
    close(k1, [-0.693147, 0.693147])
    close(k2, [0.240227, 0.240227])
    close(k3, [0.306853, 0.193147])
    s = ratio_stats("x", t([2.0, 0.5]), torch.log(t([2.0, 0.5])))
    assert float(s["x/kl_k1"]) == pytest.approx(0.0, abs=ATOL)
    assert float(s["x/kl_k2"]) == pytest.approx(0.240227, abs=ATOL)
    assert float(s["x/kl_k3"]) == pytest.approx(0.25, abs=ATOL)
    assert float(s["x/chi2_token"]) == pytest.approx(1.125, abs=ATOL)


def test_K3_train_rollout_abs_diff_is_seq_mean():
    a = t([[0.1, 0.3], [0.5, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    assert abs_diff_seq_mean(a, torch.zeros_like(a), mask).item() == pytest.approx(0.35)


# ---------------------------------------------------------------- §14 N: pitfalls


def test_N1_log_ratio_clamped_before_exp():
    r = safe_ratio(t([100.0]), t([0.0]))
    assert r.item() == pytest.approx(4.851652e8, rel=1e-6)
    assert torch.isfinite(safe_ratio(torch.tensor([100.0]), torch.tensor([0.0]))).all()


def test_N2_minus_inf_padding_gives_zero_loss_and_grad():
    ninf = -math.inf
    lp = t([[math.log(0.5), ninf]]).requires_grad_(True)
    inputs = LossInputs(
        logprobs=lp,
        proximal_logprobs=t([[math.log(0.4), ninf]]),
        rollout_logprobs=t([[math.log(0.4), ninf]]),
        behavior_logprobs=t([[math.log(0.4), ninf]]),
        advantages=t([[1.0, math.nan]]),
        loss_mask=torch.tensor([[True, False]]),
    )
    out = compis_loss(inputs, CompISConfig())
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1].item() == 0.0
    assert all(math.isfinite(v) for v in out.metrics.values())
    lp.grad = None
    pad_only = LossInputs(
        logprobs=lp,
        proximal_logprobs=inputs.proximal_logprobs,
        rollout_logprobs=inputs.rollout_logprobs,
        behavior_logprobs=inputs.behavior_logprobs,
        advantages=inputs.advantages,
        loss_mask=torch.tensor([[False, False]]),
    )
    out = compis_loss(pad_only, CompISConfig())
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros_like(lp))
