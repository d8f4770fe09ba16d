"""The loss and advantage flags of `train_async.py`, until the `loss` package owns them.

Owns only argparse wiring (names, defaults, help) of `--advantage-estimator` and the CompIS/PPO
flags; `slime_async.config._loss_config` turns them into the loss config. Every other flag group
lives next to its component's config dataclass.
"""

from __future__ import annotations

import argparse

from loss import CompISConfig
from slime_async.rollout.config import RolloutConfig

CORRECTION_METHODS = ("cap", "clip", "icepop", "none")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def add_loss_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("loss (CompIS)")
    d = CompISConfig()
    for src, name in (
        ("staleness", "staleness (r3 = pi_k / pi_j^Meg)"),
        ("engine", "engine mismatch (r2 = pi_j^Meg / pi_j^SGL)"),
    ):
        g.add_argument(
            f"--{src}-correction-method",
            choices=CORRECTION_METHODS,
            default=str(getattr(d, f"{src}_method")),
            help=f"Correction of the {name} ratio.",
        )
        g.add_argument(
            f"--{src}-correction-low",
            type=float,
            default=getattr(d, f"{src}_low"),
            help=f"Lower bound l of the {src} correction (clip/icepop).",
        )
        g.add_argument(
            f"--{src}-correction-high",
            type=float,
            default=getattr(d, f"{src}_high"),
            help=f"Upper bound u of the {src} correction.",
        )
    g.add_argument("--eps-clip", type=float, default=d.eps_clip, help="PPO clip epsilon (low).")
    g.add_argument(
        "--eps-clip-high",
        type=float,
        default=None,
        help="PPO clip epsilon (high); DAPO clip-higher uses 0.28. Default: --eps-clip.",
    )
    g.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip constant c > 1.")
    g.add_argument(
        "--loss-agg-mode",
        default=str(d.agg_mode),
        choices=[
            "token-mean",
            "seq-mean-token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-sum-norm",
        ],
        help="Loss aggregation.",
    )
    g.add_argument(
        "--loss-scale-factor",
        type=float,
        default=None,
        help="Constant H of seq-mean-token-sum-norm (default: max response length).",
    )
    g.add_argument(
        "--denom",
        choices=["keep", "drop"],
        default=str(d.denom),
        help="Masked tokens keep (default) or leave the loss denominator.",
    )
    g.add_argument("--no-loss-diagnostics", action="store_true",
                   help="Skip per-source IS diagnostics (slightly faster).")  # fmt: skip


def add_advantage_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("advantages")
    g.add_argument(
        "--advantage-estimator",
        choices=ADVANTAGE_ESTIMATORS,
        default=RolloutConfig().advantage_estimator,
        help="Advantage estimator.",
    )
