"""Contract tests for `loss.registry`: named losses, the dotted-path plugin hook, and the
adapter with slime's custom-loss calling convention `fn(args, batch, logits, sum_of_sample_mean)`."""

from __future__ import annotations

import math
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from loss import (
    CompISConfig,
    LossInputs,
    LossOutputs,
    available_losses,
    compis_config_from_args,
    compis_loss,
    get_loss,
    load_function,
    make_slime_loss,
    register_loss,
    resolve_loss,
)
from loss.registry import response_logprobs
from loss.slime_adapter import SLIME_METRIC_KEYS

torch.set_num_threads(1)
F64 = torch.float64


def c_inputs():
    ln = lambda p: torch.log(torch.tensor([p], dtype=F64))  # noqa: E731
    lp = ln([0.5, 0.33, 0.3, 0.24]).requires_grad_(True)
    return lp, LossInputs(
        logprobs=lp,
        proximal_logprobs=ln([0.5, 0.3, 0.6, 0.24]),
        rollout_logprobs=ln([0.5, 0.1, 0.8, 0.4]),
        behavior_logprobs=ln([0.5, 0.3, 0.2, 0.6]),
        advantages=torch.tensor([[1.0, 1.0, -1.0, 1.0]], dtype=F64),
        loss_mask=torch.ones(1, 4, dtype=torch.bool),
    )


BUILTIN = ("compis", "ppo", "decoupled_ppo", "single_ratio", "m2po", "gspo", "prime_masked_is")
"""The losses the package ships (other tests register plugins into the same registry)."""


def test_every_registered_loss_runs_and_backpropagates():
    assert set(BUILTIN) <= set(available_losses())
    for name in BUILTIN:
        lp, inputs = c_inputs()
        fn = get_loss(name)
        out = fn(inputs)
        assert isinstance(out, LossOutputs), name
        assert torch.isfinite(out.loss), name
        out.loss.backward()
        assert lp.grad is not None and torch.isfinite(lp.grad).all(), name
        assert all(isinstance(v, float) for v in out.metrics.values()), name
    _, inputs = c_inputs()
    assert get_loss("compis")(
        inputs, CompISConfig(engine_method="none", staleness_method="none")
    ).loss.item() == pytest.approx(-1.075)


def test_every_registered_loss_accepts_a_compis_config():
    """The trainer holds one CompISConfig and switches losses by name."""
    cfg = CompISConfig(staleness_method="cap", staleness_high=2.0, eps_clip_high=0.28)
    for name in BUILTIN:
        lp, inputs = c_inputs()
        out = get_loss(name)(inputs, cfg)
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all(), name
    _, inputs = c_inputs()
    assert get_loss("decoupled_ppo")(inputs, cfg).loss.item() == pytest.approx(-0.25)  # B2
    assert get_loss("decoupled_ppo")(inputs, {"cap": 2.0}).loss.item() == pytest.approx(-0.25)
    assert get_loss("single_ratio")(inputs, cfg).loss.item() == pytest.approx(-0.25)
    b4 = get_loss("ppo")(inputs, CompISConfig(eps_clip_high=0.28))
    assert b4.loss.item() == pytest.approx(-0.575)  # B4: no behaviour weight
    assert "loss/compis_fallback" not in b4.metrics
    with pytest.raises(ValueError, match="takes a M2POConfig"):
        get_loss("m2po")(inputs, 3)


def test_the_uncorrected_and_single_ratio_baselines_log_the_train_rollout_gap():
    """The stability lab compares losses by the train-rollout log-prob gap: ppo, decoupled_ppo
    and single_ratio (TIS/IcePop) log it like compis, from the same π_k and π_SGL."""
    _, inputs = c_inputs()
    want = (inputs.proximal_logprobs - inputs.rollout_logprobs).abs().mean().item()
    for name in ("compis", "ppo", "decoupled_ppo", "single_ratio"):
        m = get_loss(name)(inputs).metrics
        assert m["mismatch/train_rollout_logprob_abs_diff"] == pytest.approx(want), name
        assert "is/combined/p99" in m, name
    assert "is/weight/mean" in get_loss("single_ratio")(inputs).metrics  # its own weight kept


def test_unknown_and_duplicate_names():
    with pytest.raises(ValueError, match="unknown loss 'nope'; choose one of"):
        get_loss("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_loss("compis", compis_loss)

    @register_loss("test_only_double_ppo", replace=True)
    def double(inputs, cfg=None):
        out = get_loss("ppo")(inputs, cfg)
        return LossOutputs(out.loss * 2, out.metrics)

    _, inputs = c_inputs()
    assert resolve_loss("test_only_double_ppo")(inputs).loss.item() == pytest.approx(
        2 * get_loss("ppo")(inputs).loss.item()
    )


def test_dotted_path_plugin(tmp_path, monkeypatch):
    pkg = tmp_path / "myplugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "losses.py").write_text(
        textwrap.dedent(
            """
            from loss import LossOutputs, compis_loss

            def half_compis(inputs, cfg):
                out = compis_loss(inputs, cfg)
                return LossOutputs(out.loss / 2, {**out.metrics, "plugin/used": 1.0})

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_loss("myplugins.losses.half_compis")
    assert fn is load_function("myplugins.losses:half_compis")
    _, inputs = c_inputs()
    cfg = CompISConfig(engine_method="none", staleness_method="none")
    out = fn(inputs, cfg)
    assert out.loss.item() == pytest.approx(-1.075 / 2)
    assert out.metrics["plugin/used"] == 1.0
    with pytest.raises(ValueError, match=r"cannot import module 'myplugins\.nothere'"):
        load_function("myplugins.nothere.f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_function("myplugins.losses.missing")
    with pytest.raises(ValueError, match="not a function"):
        load_function("myplugins.losses.NOT_CALLABLE")
    with pytest.raises(ValueError, match="not a dotted path"):
        load_function("nodots")
    sys.modules.pop("myplugins.losses", None)
    sys.modules.pop("myplugins", None)


# ------------------------------------------------------------------ slime adapter


def slime_sum_of_sample_mean(response_lengths, loss_masks):
    """slime's reducer semantics (CP = 1): Σ_i Σ_t x·m / max(Σ_t m, 1) per sample."""

    def reduce(x):
        out, start = 0.0, 0
        for n, m in zip(response_lengths, loss_masks):
            m = m.to(x.dtype)
            out = out + (x[start : start + n] * m).sum() / m.sum().clamp(min=1)
            start += n
        return out

    return reduce


def slime_batch(seed=0, vocab=11, with_behavior=True):
    g = torch.Generator().manual_seed(seed)
    prompt_lens, resp_lens = [3, 2, 4], [4, 5, 2]
    tokens = [torch.randint(vocab, (p + r,), generator=g) for p, r in zip(prompt_lens, resp_lens)]
    total = [p + r for p, r in zip(prompt_lens, resp_lens)]
    emb = torch.randn(vocab, 8, generator=g, dtype=F64)
    head = torch.randn(8, vocab, generator=g, dtype=F64, requires_grad=True)
    logits = (emb[torch.cat(tokens)] @ head).unsqueeze(0)  # [1, T, V], packed
    masks = [torch.tensor([1, 1, 1, 0]), torch.tensor([1, 1, 1, 1, 1]), torch.tensor([0, 1])]
    with torch.no_grad():
        cur, _ = response_logprobs(
            logits, unconcat_tokens=tokens, total_lengths=total, response_lengths=resp_lens
        )
    noise = lambda s: [c + 0.3 * torch.randn(c.shape, generator=g, dtype=F64) for c in s]  # noqa: E731
    batch = {
        "unconcat_tokens": tokens,
        "total_lengths": total,
        "response_lengths": resp_lens,
        "loss_masks": masks,
        "advantages": [torch.full((r,), a, dtype=F64) for r, a in zip(resp_lens, (1.0, -0.5, 2.0))],
        "log_probs": noise(cur),
        "rollout_log_probs": noise(cur),
    }
    if with_behavior:
        batch["behavior_log_probs"] = noise(cur)
    return batch, logits, head


def test_response_logprobs_follow_next_token_alignment():
    batch, logits, _ = slime_batch()
    lps, _ = response_logprobs(
        logits,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
    )
    # sample 1 starts at offset 7 (first sample has 3 + 4 tokens); its response is tokens[2:7]
    toks = batch["unconcat_tokens"][1]
    want = [torch.log_softmax(logits[0, 7 + p - 1], -1)[toks[p]] for p in range(2, 7)]
    torch.testing.assert_close(lps[1], torch.stack(want))


@pytest.mark.parametrize("with_behavior", [True, False])
def test_slime_adapter_equals_compis_with_slime_denominators(with_behavior):
    batch, logits, head = slime_batch(with_behavior=with_behavior)
    cfg = CompISConfig(
        engine_method="clip", engine_high=2.0, staleness_method="cap", staleness_high=2.0
    )
    reducer = slime_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"])
    loss, metrics = make_slime_loss(cfg)(SimpleNamespace(), batch, logits, reducer)
    (g_adapter,) = torch.autograd.grad(loss, head, retain_graph=True)
    assert metrics["compis/fallback_frac"].item() == (0.0 if with_behavior else 3.0)  # 3 samples
    assert all(torch.is_tensor(v) and v.dim() == 0 for v in metrics.values())
    assert "is/drift/mean" in metrics and math.isfinite(float(metrics["is/weight/mean"]))
    # the same loss through the package's own API: Σ_i mean_i = seq-mean-token-mean × 1 sequence
    lps, _ = response_logprobs(
        logits,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
    )
    lengths = torch.tensor(batch["response_lengths"])
    ref = compis_loss(
        LossInputs(
            logprobs=torch.cat(lps),
            proximal_logprobs=torch.cat(batch["log_probs"]),
            rollout_logprobs=torch.cat(batch["rollout_log_probs"]),
            behavior_logprobs=torch.cat(batch["behavior_log_probs"]) if with_behavior else None,
            advantages=torch.cat(batch["advantages"]),
            loss_mask=torch.cat(batch["loss_masks"]).bool(),
            cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            global_num_seqs=1.0,
        ),
        CompISConfig(
            engine_method="clip",
            engine_high=2.0,
            staleness_method="cap",
            staleness_high=2.0,
            agg_mode="seq-mean-token-mean",
            diagnostics=False,
        ),
    )
    assert loss.item() == pytest.approx(ref.loss.item(), abs=1e-12)
    (g_ref,) = torch.autograd.grad(ref.loss, head)
    torch.testing.assert_close(g_adapter, g_ref, atol=1e-12, rtol=0)


def test_slime_entry_point_reads_config_from_args():
    fn = load_function("loss.registry.slime_compis_loss")
    batch, logits, head = slime_batch(seed=1)
    args = SimpleNamespace(
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=3.0,
        rollout_temperature=1.0,
        compis_engine_method="icepop",
        compis_engine_low=0.5,
        compis_engine_high=2.0,
        compis_diagnostics=False,
    )
    cfg = compis_config_from_args(args)
    assert (cfg.eps_clip_high, cfg.dual_clip_c, cfg.engine_method, cfg.diagnostics) == (
        0.28,
        3.0,
        "icepop",
        False,
    )
    reducer = slime_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"])
    loss, metrics = fn(args, batch, logits, reducer)
    loss.backward()
    assert torch.isfinite(head.grad).all() and head.grad.abs().sum() > 0
    assert list(metrics) == list(SLIME_METRIC_KEYS)
    with pytest.raises(ValueError, match="engine_method='bogus'"):
        compis_config_from_args(SimpleNamespace(compis_engine_method="bogus"))


def test_loss_package_is_a_leaf():
    """Importing `loss` (and its slime adapter) never pulls in slime_async."""
    import subprocess

    code = "import sys, loss, loss.registry; print(any(m.startswith('slime_async') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plain_ppo_still_reports_every_off_policy_source():
    import torch

    from loss import CompISConfig, LossInputs
    from loss.registry import get_loss

    g = torch.Generator().manual_seed(0)
    lp_s = -torch.rand(2, 5, generator=g)
    inputs = LossInputs(
        logprobs=(lp_s + 0.1).requires_grad_(),
        proximal_logprobs=lp_s + 0.1,
        rollout_logprobs=lp_s,
        behavior_logprobs=lp_s + 0.05,
        advantages=torch.ones(2, 5),
        loss_mask=torch.ones(2, 5, dtype=torch.bool),
    )
    m = get_loss("ppo")(inputs, CompISConfig()).metrics
    assert abs(m["mismatch/train_rollout_logprob_abs_diff"] - 0.1) < 1e-5
    assert abs(m["mismatch/engine_logprob_abs_diff"] - 0.05) < 1e-5
    assert "is/staleness/mean" in m and "is/engine/mean" in m
    assert not any(k.startswith("is/weight/") for k in m)  # no weight is applied
    quiet = get_loss("ppo")(inputs, CompISConfig(diagnostics=False)).metrics
    assert "mismatch/train_rollout_logprob_abs_diff" not in quiet


# ------------------------------------------------------------------ advantage estimators


def test_advantage_registry_covers_the_estimators_and_isolates_invalid_samples():
    from loss import (
        available_advantages,
        broadcast_to_tokens,
        compute_advantages,
        get_advantage,
        grpo_advantages,
        register_advantage,
    )

    assert {"grpo", "dr_grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(
        available_advantages()
    )
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.ones(6, 3, dtype=torch.bool)
    valid = torch.tensor([True, True, True, False, True, True])
    mask[3] = False  # an invalid sample has an empty mask
    a = compute_advantages("grpo", rewards, groups, valid, mask)
    # spec A1 on the three valid members of group 0 (R = [1, 0, 0]): the invalid one is alone
    ref = grpo_advantages(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, dtype=torch.long))
    assert torch.allclose(a[:3, 0], ref) and (a[3] == 0).all()
    assert torch.allclose(a[4:, 0], torch.tensor([0.707106, -0.707106]), atol=1e-5)  # spec A4
    dr = compute_advantages("dr_grpo", rewards, groups, valid, mask)
    ref_dr = grpo_advantages(rewards[:3], groups[:3], std_normalize=False)
    assert torch.equal(dr[:3], broadcast_to_tokens(ref_dr, mask[:3]))
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        out = compute_advantages(name, rewards, groups, valid, mask)
        assert out.shape == mask.shape and (out[~mask] == 0).all(), name
        assert abs(float(out[mask].mean())) < 1e-6, name  # globally whitened
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'; choose one of"):
        compute_advantages("nope", rewards, groups, valid, mask)

    def constant(r, g, m):
        return torch.where(m, 1.0, 0.0)

    register_advantage("test_only_constant", constant, replace=True)
    assert get_advantage("test_only_constant") is constant
    assert torch.equal(
        compute_advantages("test_only_constant", rewards, groups, valid, mask), mask.float()
    )
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo", constant)
