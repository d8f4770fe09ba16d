"""The entropy bonus and the KL penalty to the reference policy in a real train step (world size
1, tiny MoE): the reference forward runs only when the loss reads π_ref, the KL is 0 while the
weights equal the reference and grows after updates, the terms add up to `loss/total`, and a
resume without `--ref-load` is refused."""

from __future__ import annotations

import pytest
import torch

from loss import LossSelection
from loss.regularizers import RegularizerConfig
from slime_async.contracts.model import TINY_MOE

pytestmark = pytest.mark.timeout(150)
torch.set_num_threads(1)


def _trainer(reg=None, **kw):
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(
        lr=5e-3,
        micro_batch_size=8,
        seed=3,
        clip_grad=0.0,
        loss=LossSelection(name="ppo", regularizers=reg),
        **kw,
    )
    return MegatronTrainer(cfg, TINY_MOE)


def _batch(seed=0):
    from slime_async.trainer.testing import random_batch

    return random_batch(TINY_MOE, batch=8, width=16, prompt=5, seed=seed)


def test_kl_to_reference_is_zero_at_the_start_and_grows():
    reg = RegularizerConfig(kl_coef=0.5, kl_type="low_var_kl")
    tr, plain = _trainer(reg), _trainer(None)
    m1, p1 = tr.train_step(_batch(0)), plain.train_step(_batch(0))
    assert "timing/reference_logprobs_s" in m1 and "timing/reference_logprobs_s" not in p1
    assert abs(m1["loss/kl_ref"]) < 1e-7  # π_θ = π_ref before the first update
    # low_var_kl has zero gradient at π_θ = π_ref: the first update is plain PPO's
    for (n, a), (_, b) in zip(tr.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=n)
    m2 = tr.train_step(_batch(1))
    m3 = tr.train_step(_batch(2))
    assert 0 < m2["loss/kl_ref"] < m3["loss/kl_ref"]
    for m in (m1, m2, m3):
        assert m["loss/total"] == pytest.approx(m["loss/policy"] + 0.5 * m["loss/kl_ref"], abs=1e-6)


def test_entropy_bonus_is_the_token_mean_entropy():
    tr = _trainer(RegularizerConfig(entropy_coef=0.1))
    m = tr.train_step(_batch(0))
    assert m["loss/entropy"] == pytest.approx(m["policy/entropy"], rel=1e-5)
    assert m["loss/total"] == pytest.approx(m["loss/policy"] - 0.1 * m["loss/entropy"], abs=1e-6)
    assert "timing/reference_logprobs_s" not in m  # no reference forward without a KL term


def test_resume_without_ref_load_is_refused_and_ref_load_restores_the_reference(tmp_path):
    reg = RegularizerConfig(kl_coef=1.0, kl_type="k2")
    tr = _trainer(reg, save=str(tmp_path / "ck"))
    ref_dir = tr.save_weights(tmp_path / "v0")  # the run's initial weights
    tr.train_step(_batch(0))
    tr.train_step(_batch(1))
    kl_before = tr.train_step(_batch(2))["loss/kl_ref"]
    tr.save_checkpoint()
    with pytest.raises(ValueError, match="--ref-load"):
        _trainer(reg, load=str(tmp_path / "ck"))
    resumed = _trainer(reg, load=str(tmp_path / "ck"), ref_load=str(ref_dir))
    for (n, a), (_, b) in zip(resumed.model.named_parameters(), tr.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=n)  # the live weights are the resumed
    again = resumed.train_step(_batch(3))["loss/kl_ref"]
    assert again > 0.3 * kl_before > 0  # the reference is v0, not the resumed weights (KL ~ 0)
