"""Flag groups of `train_async.py` owned by the run: loss, rollout/data, async schedule, run.

Owns only argparse wiring (names, defaults, help). Turning flags into component configs, and
every rule across flags, lives in `slime_async.config.validate`. Component-owned groups (trainer,
router) come from their packages.
"""

from __future__ import annotations

import argparse

from data_worker.config import DataWorkerConfig, PartialRolloutPolicy
from loss import CompISConfig
from slime_async.rollout.config import RolloutConfig
from slime_async.supervisor import SupervisorConfig

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


def add_rollout_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rollout and data")
    d = RolloutConfig()
    g.add_argument(
        "--rollout-batch-size", type=int, default=d.rollout_batch_size, help="Prompts per rollout."
    )
    g.add_argument(
        "--n-samples-per-prompt",
        type=int,
        default=d.n_samples_per_prompt,
        help="Samples per prompt (group size).",
    )
    g.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step (default: rollout_batch_size x n / "
        "num_steps_per_rollout).",
    )
    g.add_argument(
        "--num-steps-per-rollout", type=int, default=1, help="Optimizer steps per rollout."
    )
    g.add_argument(
        "--rollout-max-response-len",
        type=int,
        default=d.max_response_len,
        help="Most new tokens per sample.",
    )
    g.add_argument(
        "--rollout-temperature", type=float, default=d.temperature, help="Sampling temperature."
    )
    g.add_argument("--rollout-top-p", type=float, default=d.top_p, help="Nucleus sampling mass.")
    g.add_argument(
        "--advantage-estimator",
        choices=ADVANTAGE_ESTIMATORS,
        default=d.advantage_estimator,
        help="Advantage estimator.",
    )
    g.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="DAPO: drop zero-variance groups and refill with fresh prompts.",
    )
    g.add_argument(
        "--prompt-data",
        default=None,
        help="jsonl/parquet prompts (default: built-in verifiable tasks).",
    )
    g.add_argument("--input-key", default=d.input_key, help="Prompt field of --prompt-data.")
    g.add_argument("--label-key", default=d.label_key, help="Label field of --prompt-data.")
    g.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="Apply the tokenizer chat template to prompts.",
    )
    g.add_argument(
        "--strict-data",
        action="store_true",
        help="Stop at the first malformed data row (file:line) instead of skipping.",
    )
    g.add_argument(
        "--custom-rm-path",
        default=None,
        help="Dotted path of a reward function (default: exact match / math-verify).",
    )
    g.add_argument(
        "--eval-interval",
        type=int,
        default=d.eval_interval,
        help="Evaluate every N train steps (0: never).",
    )
    g.add_argument("--eval-prompts", type=int, default=d.eval_prompts,
                   help="Held-out prompts per evaluation.")  # fmt: skip


def add_async_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("async schedule and staleness")
    d = DataWorkerConfig()
    g.add_argument(
        "--max-staleness",
        type=int,
        default=2,
        help="S: 0 synchronous, 1 one-step off-policy, >1 fully async.",
    )
    g.add_argument(
        "--fifo-window",
        type=float,
        default=None,
        help="W: completed groups consumable within [head, head+W); 1 strict order, "
        "inf arrival order (default: 2 x groups per step).",
    )
    g.add_argument(
        "--max-off-policy-steps",
        type=int,
        default=None,
        help="Drop groups with k - j_min > N before training (default: off).",
    )
    g.add_argument(
        "--partial-rollout",
        choices=[p.value for p in PartialRolloutPolicy],
        default=PartialRolloutPolicy.CONTINUE.value,
        help="At weight sync: continue partial rollouts (per-token versions) or "
        "requeue them whole.",
    )
    g.add_argument(
        "--no-length-probe",
        action="store_true",
        help="Disable length-probe dispatch (dispatch every sample at once).",
    )
    g.add_argument(
        "--max-inflight",
        type=int,
        default=d.max_inflight,
        help="Most concurrent generate requests.",
    )
    g.add_argument("--update-weights-interval", type=int, default=1,
                   help="Push weights to the engines every N train steps.")  # fmt: skip


def add_run_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run")
    g.add_argument("--run-dir", default="runs/default", help="Run directory (metrics, weights).")
    g.add_argument("--num-steps", type=int, default=None, help="Train steps to run.")
    g.add_argument(
        "--num-rollout",
        type=int,
        default=None,
        help="slime-style: rollouts to run (steps = num_rollout x steps per rollout).",
    )
    g.add_argument(
        "--save-interval",
        type=int,
        default=0,
        help="Checkpoint every N steps (0: only at the end, when --save is given).",
    )
    g.add_argument(
        "--engine-dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="Embedded engine inference dtype.",
    )
    g.add_argument(
        "--engine-max-running-requests",
        type=int,
        default=64,
        help="Continuous-batch size of each engine.",
    )
    g.add_argument(
        "--colocate",
        action="store_true",
        help="Share all cores between trainer and engines (no pinning).",
    )
    g.add_argument(
        "--trainer-cores",
        default=None,
        help="Comma-separated CPU cores for the trainer (default: first half).",
    )
    g.add_argument(
        "--rollout-cores",
        default=None,
        help="Comma-separated CPU cores for the engines (default: second half).",
    )
    g.add_argument(
        "--warmstart-steps",
        type=int,
        default=300,
        help="Supervised warm-start steps on the built-in tasks (cached in run dir).",
    )
    g.add_argument(
        "--engine-restart-after",
        type=float,
        default=SupervisorConfig().restart_after_s,
        help="Restart an engine the router has held unhealthy this many seconds.",
    )
    g.add_argument(
        "--engine-down-timeout",
        type=float,
        default=SupervisorConfig().all_down_timeout_s,
        help="With no healthy engine for this long, stop the run with a checkpoint.",
    )
    g.add_argument(
        "--no-keep-old-actor",
        dest="keep_old_actor",
        action="store_false",
        help="Do not keep version snapshots (CompIS then uses the combined ratio).",
    )
    g.add_argument("--use-wandb", action="store_true", help="Log to Weights & Biases.")
    g.add_argument("--use-tensorboard", action="store_true", help="Log to TensorBoard.")
