"""slime flags implemented with slime's meaning: --normalize-advantages (whitening over the
batch), --disable-rewards-normalization (raw rewards), --use-unbiased-kl (the KL times the
importance ratio), --apply-chat-template-kwargs (data rendering and `chat_template_kwargs`),
--use-rollout-logprobs and --train-env-vars (their parse-time rules; the trainer and Ray sides
are in tests/test_trainer_train.py and tests/test_trainer_actor.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loss import LossInputs, compute_advantages
from loss.kl import KLType, kl_penalty
from loss.registry import resolve_loss_spec
from loss.regularizers import RegularizerConfig, with_regularizers
from slime_async.config import parse_config
from slime_async.contracts.chat import ChatError, render_chat, request_template_kwargs
from slime_async.engine.testing import THINKING_SWITCH_TEMPLATE, ascii_chat_tokenizer

# two groups of two samples, one response token each (plus one masked position)
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 1, 1])
VALID = torch.ones(4, dtype=torch.bool)
MASK = torch.tensor([[True, False]] * 4)


def _adv(name: str, **kw) -> torch.Tensor:
    return compute_advantages(name, REWARDS, GROUPS, VALID, MASK, **kw)[:, 0]


def test_raw_rewards_are_the_advantages_without_group_normalisation():
    assert _adv("grpo").tolist() == pytest.approx([0.70710, -0.70710, 0.0, 0.0], abs=1e-4)
    assert _adv("grpo", normalize_rewards=False).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert _adv("dr_grpo", normalize_rewards=False).tolist() == [1.0, 0.0, 1.0, 1.0]
    # REINFORCE++-baseline whitens the raw rewards over the batch: mean 0.75, unbiased std 0.5
    raw = _adv("reinforce_plus_plus_baseline", normalize_rewards=False)
    assert raw.tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5], abs=1e-6)
    with pytest.raises(ValueError, match="not estimator 'reinforce_plus_plus'"):
        _adv("reinforce_plus_plus", normalize_rewards=False)


def test_normalize_advantages_whitens_over_the_batchs_trained_tokens():
    white = compute_advantages("grpo", REWARDS, GROUPS, VALID, MASK, whiten_advantages=True)
    vals = white[MASK]
    assert float(vals.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(vals.std()) == pytest.approx(1.0, abs=1e-6)  # unbiased, as slime's
    assert bool((white[~MASK] == 0).all())  # untrained positions stay 0
    raw_white = _adv("dr_grpo", normalize_rewards=False, whiten_advantages=True)
    assert raw_white.tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5], abs=1e-6)


@pytest.mark.parametrize("kind", list(KLType))
def test_unbiased_kl_is_the_estimate_times_the_importance_ratio(kind):
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5])
    old = torch.tensor([-1.2, -2.5, -0.1])
    ratio = torch.exp(lp - old)
    got = kl_penalty(lp, ref, kind, importance_ratio=ratio)
    plain = kl_penalty(lp, ref, KLType.K3 if kind is KLType.LOW_VAR_KL else kind)
    want = (ratio * plain).clamp(-10, 10) if kind is KLType.LOW_VAR_KL else ratio * plain
    torch.testing.assert_close(got, want)
    got.sum().backward()  # the ratio carries gradient: d(r k)/dlp = r k + r dk/dlp
    assert lp.grad is not None and bool(torch.isfinite(lp.grad).all())


def test_the_regularizer_multiplies_the_kl_by_pi_theta_over_pi_old():
    n = 6
    lp = torch.linspace(-2.0, -0.5, n)
    old = lp - 0.3  # π_θ / π_old = e^0.3 on every token
    inputs = LossInputs(
        logprobs=lp.view(1, n),
        proximal_logprobs=old.view(1, n),
        rollout_logprobs=old.view(1, n),
        advantages=torch.zeros(1, n),
        loss_mask=torch.ones(1, n, dtype=torch.bool),
        reference_logprobs=(lp - 0.1).view(1, n),
    )
    spec = resolve_loss_spec("ppo")
    cfg = spec.config()
    reg = RegularizerConfig(kl_coef=1.0, kl_type="k1")
    plain = with_regularizers(spec, reg).fn(inputs, cfg).metrics["loss/kl_ref"]
    unbiased = RegularizerConfig(kl_coef=1.0, kl_type="k1", unbiased_kl=True)
    got = with_regularizers(spec, unbiased).fn(inputs, cfg).metrics["loss/kl_ref"]
    assert plain == pytest.approx(0.1, abs=1e-6)
    assert got == pytest.approx(math.exp(0.3) * 0.1, abs=1e-6)


def test_chat_template_kwargs_reach_the_template():
    tok = ascii_chat_tokenizer(THINKING_SWITCH_TEMPLATE)
    msgs = [{"role": "user", "content": "2+3?"}]
    plain = render_chat(tok, msgs)
    off = render_chat(tok, msgs, template_kwargs={"enable_thinking": False})
    assert off[: len(plain)] == plain and tok.decode(off[len(plain) :]) == "<think>\n\n</think>\n\n"
    assert request_template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}) == {
        "enable_thinking": False
    }
    for bad, says in (([1], "must be an object"), ({"tokenize": False}, "cannot set")):
        with pytest.raises(ChatError, match=says):
            request_template_kwargs({"chat_template_kwargs": bad})


def test_apply_chat_template_kwargs_render_the_data(tmp_path):
    from slime_async.rollout.data.datasets import DatasetConfig, load_dataset

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "2+3?", "label": "5"}) + "\n")
    tok = ascii_chat_tokenizer(THINKING_SWITCH_TEMPLATE)
    cfg = DatasetConfig(path=str(data), apply_chat_template=True)
    off = DatasetConfig(
        path=str(data), apply_chat_template=True, chat_template_kwargs={"enable_thinking": False}
    )
    plain_row = load_dataset(cfg, tokenizer=tok).rows[0]
    off_row = load_dataset(off, tokenizer=tok).rows[0]
    assert off_row.prompt_text == plain_row.prompt_text + "<think>\n\n</think>\n\n"


def _parse(tmp_path, *argv: str):
    return parse_config(["--run-dir", str(tmp_path / "run"), *argv])


def _refused(tmp_path, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        _parse(tmp_path, *argv)
    return capsys.readouterr().err


def test_the_flags_parse_with_slimes_meanings(tmp_path, capsys):
    cfg = _parse(
        tmp_path,
        "--normalize-advantages",
        "--disable-rewards-normalization",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.1",
        "--use-unbiased-kl",
        "--train-env-vars",
        '{"NCCL_ALGO": "Ring"}',
        "--apply-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--loss",
        "ppo",
        "--use-rollout-logprobs",
    )
    assert cfg.rollout.normalize_advantages and not cfg.rollout.rewards_normalization
    assert cfg.rollout.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.trainer.loss.regularizers.unbiased_kl
    assert cfg.trainer.env_vars == {"NCCL_ALGO": "Ring"} and cfg.trainer.use_rollout_logprobs
    for argv, says in (
        (("--use-unbiased-kl",), "--use-unbiased-kl applies only with --use-kl-loss"),
        (
            ("--disable-rewards-normalization", "--advantage-estimator", "reinforce_plus_plus"),
            "not --advantage-estimator reinforce_plus_plus",
        ),
        (("--use-rollout-logprobs",), "--use-rollout-logprobs with --loss compis"),
        (("--train-env-vars", "A=1"), "is not JSON"),
        (("--train-env-vars", '{"A": 1}'), "a JSON object of strings"),
        (("--apply-chat-template-kwargs", "[1]"), "must be a JSON object"),
    ):
        assert says in _refused(tmp_path, capsys, *argv), argv
