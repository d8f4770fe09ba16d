"""slime's loss-side flags, each with slime's meaning or refused with our equivalent.

Owns: `add_slime_loss_args` (the flags below, added to the loss group by `loss.cli`),
`slime_loss_settings` (what they set, as config fields of the selected loss, so conflicts
with our own flags are refused like any setting given twice), `check_loss_type` and
`advantage_estimator_from_args`. Must never import `slime_async`.

| slime flag | here |
|---|---|
| `--loss-type policy_loss` | the default loss; `--custom-loss-function-path` is then refused (slime ignores it there) |
| `--loss-type custom_loss` | needs `--custom-loss-function-path` (our contract `fn(inputs, cfg)`; a slime-signature loss is refused) |
| `--loss-type sft_loss` | refused: no SFT loss here |
| `--use-tis --tis-clip C --tis-clip-low L` | CompIS's engine correction `clip(L, C)` (slime's TIS truncates π_old/π_rollout, which is the engine ratio r2 when π_j^Meg is known) |
| `--calculate-per-token-loss` | `--loss-agg-mode token-mean` (slime's default is the per-sample mean: `seq-mean-token-mean`) |
| `--advantage-estimator grpo/reinforce_plus_plus/reinforce_plus_plus_baseline` | the same estimators |
| `--disable-grpo-std-normalization` | Dr.GRPO: `--advantage-estimator dr_grpo` |
| `--advantage-estimator gspo` | refused: `--advantage-estimator grpo --loss gspo` |
| `--advantage-estimator cispo`, `ppo` | refused: no CISPO loss, no critic |
| `--entropy-coef E` | the entropy bonus of `loss.regularizers` (any loss) |
| `--use-kl-loss --kl-loss-coef C --kl-loss-type T` | the KL penalty to the reference policy (the run's initial weights, or `--ref-load`); slime's default type k1 |
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

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


def add_slime_loss_args(g: argparse._ArgumentGroup) -> None:
    """slime's loss flags (no argparse default where a conflict must be detectable)."""
    unset = argparse.SUPPRESS
    g.add_argument("--loss-type", choices=["policy_loss", "custom_loss", "sft_loss"],
                   default=unset,
                   help="slime's: policy_loss (the selected --loss) or custom_loss (with "
                   "--custom-loss-function-path); sft_loss is not supported")  # fmt: skip
    g.add_argument("--use-tis", action="store_true", default=unset,
                   help="slime's TIS: CompIS's engine correction clip(--tis-clip-low, "
                   "--tis-clip)")  # fmt: skip
    g.add_argument("--tis-clip", type=float, default=unset,
                   help="slime's TIS upper bound C, with --use-tis (default 2.0)")  # fmt: skip
    g.add_argument("--tis-clip-low", type=float, default=unset,
                   help="slime's TIS lower bound, with --use-tis (default 0.0)")  # fmt: skip
    g.add_argument("--calculate-per-token-loss", action="store_true", default=unset,
                   help="slime's: average the loss over tokens (= --loss-agg-mode "
                   "token-mean)")  # fmt: skip
    g.add_argument("--disable-grpo-std-normalization", action="store_true", default=unset,
                   help="slime's Dr.GRPO switch (= --advantage-estimator dr_grpo)")  # fmt: skip
    g.add_argument("--entropy-coef", type=float, default=unset,
                   help="Entropy bonus weight, subtracted from the loss (default 0)")  # fmt: skip
    g.add_argument("--use-kl-loss", action="store_true", default=unset,
                   help="Add the KL penalty to the reference policy (the run's initial weights, "
                   "or --ref-load) with --kl-loss-coef")  # fmt: skip
    g.add_argument("--kl-loss-coef", type=float, default=unset,
                   help="KL penalty weight, with --use-kl-loss (default 0)")  # fmt: skip
    g.add_argument("--kl-loss-type", choices=[k.value for k in KLType], default=unset,
                   help="Per-token KL estimator, with --use-kl-loss (default k1, slime's)")  # fmt: skip


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


def check_loss_type(args: argparse.Namespace, fn: Any) -> None:
    """slime's `--loss-type` rules, and a slime-signature custom loss refused with the fix."""
    kind = getattr(args, "loss_type", None)
    path = getattr(args, "custom_loss_function_path", None)
    if kind == "sft_loss":
        raise ValueError("--loss-type sft_loss: there is no SFT loss here; this trains RL losses")
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
    out: list[tuple[str, str, Any]] = []
    tis = getattr(args, "use_tis", False)
    for flag, dest, field, default in (("--tis-clip", "tis_clip", "engine_high", 2.0),
                                       ("--tis-clip-low", "tis_clip_low", "engine_low", 0.0)):  # fmt: skip
        if hasattr(args, dest) and not tis:
            raise ValueError(f"{flag} applies only with --use-tis (slime's rule); add --use-tis")
        if tis:
            out.append((field, f"--use-tis {flag}", getattr(args, dest, default)))
    if tis:
        out.append(("engine_method", "--use-tis", "clip"))
    if getattr(args, "calculate_per_token_loss", False):
        out.append(("agg_mode", "--calculate-per-token-loss", "token-mean"))
    return out


def regularizers_from_args(args: argparse.Namespace) -> RegularizerConfig | None:
    """`--entropy-coef` and `--use-kl-loss/--kl-loss-coef/--kl-loss-type` (slime's rules: the KL
    settings apply only with `--use-kl-loss`); None when neither term is on."""
    kl_on = getattr(args, "use_kl_loss", False)
    for flag in ("kl_loss_coef", "kl_loss_type"):
        if hasattr(args, flag) and not kl_on:
            raise ValueError(f"--{flag.replace('_', '-')} applies only with --use-kl-loss")
    reg = RegularizerConfig(
        entropy_coef=getattr(args, "entropy_coef", 0.0),
        kl_coef=getattr(args, "kl_loss_coef", 0.0) if kl_on else 0.0,
        kl_type=getattr(args, "kl_loss_type", KLType.K1),
    )
    return reg if reg.active else None
