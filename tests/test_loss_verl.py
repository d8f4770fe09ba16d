"""Against verl (skipped without it: installed, or in the sidecar dir where scripts/setup.sh puts
it, see slime_async/sidecar.py): CompIS registered in verl's policy-loss
registry (by verl's own plugin mechanisms) equals verl's vanilla loss with the same rollout
correction weights for every aggregation mode, and our GSPO agrees with verl's `gspo`, at the
two edges where it used to differ (a sequence log-ratio past the clamp; one huge per-token Δ)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from slime_async.sidecar import add_to_path

SIDECAR_VERL = add_to_path("verl")  # None where verl is installed normally (or absent)
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from loss.baselines import gspo_loss  # noqa: E402
from loss.types import LossInputs  # noqa: E402

F64 = torch.float64


def actor_config(**kw):
    from verl.workers.config import ActorConfig

    base = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    return ActorConfig(**{**base, **kw})


def padded(seed=0, b=4, t=7, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    lp = (old + noise * torch.randn(b, t, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, t).clone()
    w = torch.rand(b, t, generator=g, dtype=F64) * 2 * mask
    w[0, 2] = 0.0  # a token verl's correction dropped
    return lp, old, adv, mask, w


def grad_of(loss, lp):
    (g,) = torch.autograd.grad(loss, lp)
    return g


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("global_info", [False, True])
def test_compis_in_verl_equals_verl_vanilla_with_its_weights(agg, global_info):
    from loss.verl_adapter import compis_verl_loss

    lp, old, adv, mask, w = padded(seed=1)
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    if global_info:  # verl sets these per micro-batch: DP size and whole-batch counts
        cfg.global_batch_info.update(
            dp_size=2, batch_num_tokens=40, global_batch_size=9, loss_scale_factor=16
        )
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    ref, ref_m = vanilla(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=w,
    )
    got, got_m = compis_verl_loss(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=w,
    )
    assert float(got.detach()) == pytest.approx(float(ref.detach()), abs=1e-12)
    torch.testing.assert_close(grad_of(got, lp), grad_of(ref, lp), atol=1e-12, rtol=0)
    assert got_m["actor/ppo_kl"] == pytest.approx(ref_m["actor/ppo_kl"], abs=1e-12)
    assert got_m["actor/compis_weight_masked_frac"] == pytest.approx(1 / int(mask.sum()))


def test_compis_without_verl_weights_is_dual_clip_ppo():
    from loss.verl_adapter import compis_verl_loss

    lp, old, adv, mask, _ = padded(seed=2)
    cfg = actor_config()
    ref, _ = core_algos.get_policy_loss_fn("vanilla")(old, lp, adv, mask, "token-mean", cfg, None)
    got, m = compis_verl_loss(old, lp, adv, mask, "token-mean", cfg, None)
    assert float(got.detach()) == pytest.approx(float(ref.detach()), abs=1e-12)
    assert m["actor/compis_weight_mean"] == 1.0


def test_verl_loads_the_adapter_through_its_plugin_mechanisms():
    """verl's `VERL_USE_EXTERNAL_MODULES` and the `verl.plugins` entry point both register it."""
    code = (
        "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
        "print(get_policy_loss_fn('compis').__module__)"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "loss.verl_adapter"}
    if SIDECAR_VERL is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [env.get("PYTHONPATH"), str(SIDECAR_VERL)])
        )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip().splitlines()[-1] == "loss.verl_adapter"
    ep = importlib.metadata.EntryPoint(
        name="slime_async", value="loss.verl_adapter", group="verl.plugins"
    )
    assert ep.load().VERL_LOSSES == ("compis",)
    assert core_algos.get_policy_loss_fn("compis").__name__ == "compis_verl_loss"


def _gspo_both(lp, old, adv, mask):
    cfg = actor_config(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    ref, _ = core_algos.get_policy_loss_fn("gspo")(
        old_log_prob=old,
        log_prob=lp,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode="seq-mean-token-mean",
        config=cfg,
    )
    ours = gspo_loss(
        LossInputs(
            logprobs=lp, proximal_logprobs=old, rollout_logprobs=old, advantages=adv, loss_mask=mask
        )
    ).loss
    return ours, ref


@pytest.mark.parametrize("case", ["moderate", "seq_log_ratio_past_clamp", "huge_token_delta"])
def test_gspo_agrees_with_verl(case):
    lp, old, adv, mask, _ = padded(seed=3, noise=2e-4)  # inside GSPO's ε = 3e-4/4e-4
    with torch.no_grad():
        if case == "seq_log_ratio_past_clamp":  # sequence 0: mean Δ = 12 > 10
            lp[0] = old[0] + 12.0
        elif case == "huge_token_delta":  # one token Δ = 30: a ±20 per-token clamp would differ
            lp[2, 1] = old[2, 1] + 30.0
            adv[2] = -1.0  # A < 0: the loss value is −A·s, so it shows the sequence ratio
    ours, ref = _gspo_both(lp, old, adv, mask)
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-12, abs=1e-12)
    g_ours, g_ref = grad_of(ours, lp), grad_of(ref, lp)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-12, rtol=1e-12)
    if case == "seq_log_ratio_past_clamp":
        assert float(g_ours[0].abs().sum()) == 0.0  # clamped after the stop-gradient trick
        assert float(g_ours[1:].abs().sum()) > 0.0


def test_reinforce_pp_masked_span_convention_differs_from_verl_as_documented():
    """Ours (slime's): masked tool positions count as discount steps. verl 0.9.1 carries the
    return across them undiscounted. Same outside masked spans."""
    from loss.advantages import outcome_to_token_rewards, reinforce_pp_returns

    mask = torch.tensor([[True, True, False, False, True]])
    r = outcome_to_token_rewards(torch.tensor([1.0]), mask)
    ours = reinforce_pp_returns(r, mask, gamma=0.5)
    cfg = SimpleNamespace(gamma=0.5)
    _, verl_returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        r, mask.to(F64), config=cfg
    )
    torch.testing.assert_close(ours, torch.tensor([[0.0625, 0.125, 0.0, 0.0, 1.0]], dtype=F64))
    torch.testing.assert_close(verl_returns, torch.tensor([[0.25, 0.5, 0.0, 0.0, 1.0]], dtype=F64))
    full = torch.ones(1, 3, dtype=torch.bool)
    r3 = outcome_to_token_rewards(torch.tensor([1.0]), full)
    _, v3 = core_algos.compute_reinforce_plus_plus_outcome_advantage(r3, full.to(F64), config=cfg)
    torch.testing.assert_close(reinforce_pp_returns(r3, full, gamma=0.5), v3)


def test_the_tests_package_is_this_repository_s():
    """verl's wheel ships a top-level `tests` package. Nothing of it is deleted: ours is a regular
    package first on `sys.path`, so it wins even with verl's importable (as here)."""
    import importlib.util
    import pathlib

    import tests

    here = pathlib.Path(__file__).resolve().parent
    assert pathlib.Path(tests.__file__).resolve().parent == here
    verl_dir = pathlib.Path(core_algos.__file__).resolve().parents[3]
    theirs = verl_dir / "tests" / "__init__.py"
    if theirs.is_file():  # verl 0.9.1's wheel: its `tests` is there and still loses
        assert importlib.util.find_spec("tests").origin == str(here / "__init__.py")
