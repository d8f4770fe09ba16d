"""slime's loss-side flags, each with slime's meaning or refused with our equivalent.

Owns: `SlimeLossFlags` (the flags: one field each, its docstring the help and what it means
here; docs/coming-from-slime.md has the whole slime-to-here table), `add_slime_loss_args`
(adds them to the loss group of `loss.cli`), `slime_loss_settings` (what they set, as config
fields of the selected loss, so conflicts with our own flags are refused like any setting given
twice), `regularizers_from_args`, `check_loss_type` and `advantage_estimator_from_args`. Must
never import `slime_async`.

A flag whose unset state matters (a rule refuses it without another flag) defaults to None on
the command line: given = not None; a recipe's value counts as given.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from typing import Any, Literal

from clifields import add_flags, flag, flag_name, from_args
from loss.advantages import DEFAULT_ADVANTAGE_ESTIMATOR, available_advantages
from loss.kl import KLType
from loss.regularizers import RegularizerConfig

_SLIME_ESTIMATORS = {
    "gspo": "slime's gspo is GRPO advantages with the GSPO loss: give --advantage-estimator "
    "grpo --loss gspo",
    "cispo": "there is no CISPO loss here; the nearest is --loss compis (PPO clip plus truncated "
    "IS weights)",
    "ppo": "slime's ppo estimator is GAE with a critic, and there is no critic here; use grpo, "
    "dr_grpo, reinforce_plus_plus or reinforce_plus_plus_baseline",
}

_TIS_CLIP, _TIS_CLIP_LOW = 2.0, 0.0
"""slime's defaults of `--tis-clip` and `--tis-clip-low`."""
_REG = RegularizerConfig()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SlimeLossFlags:
    """slime's loss flags (`add_slime_loss_args`), with slime's spelling and meaning."""

    loss_type: Literal["policy_loss", "custom_loss", "sft_loss"] | None = None
    """slime's: policy_loss (the selected --loss; --custom-loss-function-path is then refused,
    slime ignores it there), custom_loss (with --custom-loss-function-path, our contract
    fn(inputs, cfg); a slime-signature loss is refused) or sft_loss (= --loss sft: the NLL of
    the assistant tokens of --prompt-data's conversations, trained without engines)"""
    use_tis: bool = False
    """slime's TIS: CompIS's engine correction clip(--tis-clip-low, --tis-clip) (slime's TIS
    truncates pi_old/pi_rollout, which is the engine ratio r2 when pi_j^Meg is known)"""
    tis_clip: float | None = flag(None, derived=f"slime's {_TIS_CLIP}")
    """slime's TIS upper bound C, with --use-tis"""
    tis_clip_low: float | None = flag(None, derived=f"slime's {_TIS_CLIP_LOW}")
    """slime's TIS lower bound, with --use-tis"""
    calculate_per_token_loss: bool = False
    """slime's: average the loss over tokens (= --loss-agg-mode token-mean; slime's default is
    the per-sample mean, seq-mean-token-mean)"""
    disable_grpo_std_normalization: bool = False
    """slime's Dr.GRPO switch (= --advantage-estimator dr_grpo)"""
    entropy_coef: float = _REG.entropy_coef
    """Entropy bonus weight, subtracted from the loss (any loss)"""
    use_kl_loss: bool = False
    """Add the KL penalty to the reference policy (the run's initial weights, or --ref-load)
    with --kl-loss-coef"""
    kl_loss_coef: float | None = flag(None, derived=f"{_REG.kl_coef}")
    """KL penalty weight, with --use-kl-loss"""
    kl_loss_type: KLType | None = flag(None, derived=f"{_REG.kl_type}, slime's")
    """Per-token KL estimator, with --use-kl-loss"""
    use_unbiased_kl: bool = False
    """slime's unbiased KL (DeepSeek-V3.2), with --use-kl-loss: each token's KL estimate times
    its importance ratio pi_theta/pi_old (pi_old: the loss's old policy, the engine's log-probs
    with --use-rollout-logprobs)"""


def add_slime_loss_args(g: argparse._ArgumentGroup) -> None:
    """slime's loss flags (`SlimeLossFlags`)."""
    add_flags(g, SlimeLossFlags)


def _flag(field: str) -> str:
    return flag_name(SlimeLossFlags, field)


def advantage_estimator_from_args(args: argparse.Namespace) -> str:
    """The estimator `--advantage-estimator` and `--disable-grpo-std-normalization` select;
    slime names without an equivalent are refused with the nearest one."""
    est = getattr(args, "advantage_estimator", None) or DEFAULT_ADVANTAGE_ESTIMATOR
    if est in _SLIME_ESTIMATORS:
        raise ValueError(f"--advantage-estimator {est}: {_SLIME_ESTIMATORS[est]}")
    if est not in available_advantages():
        raise ValueError(
            f"--advantage-estimator {est!r} is not registered; choose one of "
            f"{available_advantages()} (loss.register_advantage adds one)"
        )
    if getattr(args, "disable_grpo_std_normalization", False):
        if est not in ("grpo", "dr_grpo"):
            raise ValueError(
                f"--disable-grpo-std-normalization applies to grpo, not --advantage-estimator "
                f"{est}; drop one of them"
            )
        return "dr_grpo"
    return est


def _is_slime_loss(fn: Any) -> bool:
    """slime's custom-loss signature `fn(args, batch, logits, sum_of_sample_mean)`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 and all(p.default is p.empty for p in positional[:4])


SFT_LOSS = "sft"
"""The registered loss slime's `--loss-type sft_loss` selects."""


def loss_type_name(args: argparse.Namespace, chosen: str | None) -> str | None:
    """The loss `--loss-type` selects given the one `--loss` / `--custom-loss-function-path`
    chose (None: neither): `sft_loss` is --loss sft, and refused beside another loss."""
    if getattr(args, "loss_type", None) != "sft_loss":
        return chosen
    if chosen not in (None, SFT_LOSS):
        raise ValueError(
            f"--loss-type sft_loss selects --loss {SFT_LOSS}, but {chosen} is selected too; "
            "give one of them"
        )
    return SFT_LOSS


def check_loss_type(args: argparse.Namespace, fn: Any) -> None:
    """slime's `--loss-type` rules, and a slime-signature custom loss refused with the fix."""
    kind = getattr(args, "loss_type", None)
    path = getattr(args, "custom_loss_function_path", None)
    if kind == "custom_loss" and path is None:
        raise ValueError("--loss-type custom_loss needs --custom-loss-function-path PATH")
    if kind == "policy_loss" and path is not None:
        raise ValueError(
            "--custom-loss-function-path takes effect only with --loss-type custom_loss (slime "
            "ignores it with policy_loss); give --loss-type custom_loss or drop the path"
        )
    if path is not None and _is_slime_loss(fn):
        raise ValueError(
            f"--custom-loss-function-path {path} has slime's signature (args, batch, logits, "
            "sum_of_sample_mean); here a loss is fn(inputs: loss.LossInputs, cfg) -> "
            "loss.LossOutputs on token-aligned log-probs (see loss/README.md, 'The loss seam'). "
            "Register it with loss.register_loss, or use a built-in --loss"
        )


def slime_loss_settings(args: argparse.Namespace) -> list[tuple[str, str, Any]]:
    """(config field, flag, value) for every slime flag given that sets a loss setting."""
    s = from_args(SlimeLossFlags, args)
    out: list[tuple[str, str, Any]] = []
    for name, field, default in (
        ("tis_clip", "engine_high", _TIS_CLIP),
        ("tis_clip_low", "engine_low", _TIS_CLIP_LOW),
    ):
        value = getattr(s, name)
        if value is not None and not s.use_tis:
            raise ValueError(
                f"{_flag(name)} applies only with --use-tis (slime's rule); add --use-tis"
            )
        if s.use_tis:
            out.append((field, f"--use-tis {_flag(name)}", default if value is None else value))
    if s.use_tis:
        out.append(("engine_method", "--use-tis", "clip"))
    if s.calculate_per_token_loss:
        out.append(("agg_mode", "--calculate-per-token-loss", "token-mean"))
    return out


def regularizers_from_args(args: argparse.Namespace) -> RegularizerConfig | None:
    """`--entropy-coef` and `--use-kl-loss/--kl-loss-coef/--kl-loss-type` (slime's rules: the KL
    settings apply only with `--use-kl-loss`); None when neither term is on."""
    s = from_args(SlimeLossFlags, args)
    for name in ("kl_loss_coef", "kl_loss_type"):
        if getattr(s, name) is not None and not s.use_kl_loss:
            raise ValueError(f"{_flag(name)} applies only with --use-kl-loss")
    if s.use_unbiased_kl and not s.use_kl_loss:
        raise ValueError("--use-unbiased-kl applies only with --use-kl-loss")
    kl: dict[str, Any] = {"unbiased_kl": s.use_unbiased_kl}
    if s.use_kl_loss and s.kl_loss_coef is not None:
        kl["kl_coef"] = s.kl_loss_coef
    if s.kl_loss_type is not None:
        kl["kl_type"] = s.kl_loss_type
    reg = RegularizerConfig(entropy_coef=s.entropy_coef, **kl)
    return reg if reg.active else None
