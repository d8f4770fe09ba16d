"""The command line of `train_async.py`: flag groups per component, and ALL cross-flag validation.

Owns: `RunConfig` (the run-level settings plus one config object per component), `build_parser`
and `parse_config`. Each component owns its own config dataclass (`TrainerConfig`,
`DataWorkerConfig`, `RouterConfig`, `CompISConfig`, `EngineConfig`); this module adds the
run-level and rollout flags, maps flags onto those configs, and checks every rule that involves
more than one flag in `validate()`, failing with a sentence the user can act on. Nothing here
mutates settings behind the user's back (no `--load` -> `--ref-load` rewriting).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path

from data_worker.budget import worst_case_staleness
from data_worker.config import DataWorkerConfig, PartialRolloutPolicy
from loss import CompISConfig
from router.config import RouterConfig, add_router_args
from router.config import config_from_args as router_config_from_args
from slime_async.engine.config import EngineConfig
from slime_async.modelspec import TINY_MOE, ModelSpec
from slime_async.supervisor import SupervisorConfig
from slime_async.trainer.config import TrainerConfig, add_trainer_args, trainer_config_from_args

CORRECTION_METHODS = ("cap", "clip", "icepop", "none")
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """What is generated, how it is scored, and how advantages are formed."""

    rollout_batch_size: int = 8
    """Prompts per rollout (one rollout feeds `num_steps_per_rollout` train steps)."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (GRPO group size)."""
    global_batch_size: int = 64
    """Samples per optimizer step (= groups per step x n)."""
    max_response_len: int = 48
    """Most new tokens per sample."""
    temperature: float = 1.0
    """Sampling temperature (the trainer divides logits by the same value)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    advantage_estimator: str = "grpo"
    """grpo | dr_grpo | reinforce_plus_plus | reinforce_plus_plus_baseline."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards all agree (no learning signal) and refill."""
    prompt_data: str | None = None
    """jsonl/parquet prompts; None uses the built-in verifiable task family."""
    input_key: str = "prompt"
    """Field holding the prompt in `prompt_data`."""
    label_key: str = "label"
    """Field holding the reference answer in `prompt_data`."""
    apply_chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template."""
    strict_data: bool = False
    """Fail on the first malformed data row (file and line named) instead of skipping it."""
    custom_rm_path: str | None = None
    """Dotted path of a reward function `(prompt, response_ids, label) -> float`."""
    eval_interval: int = 10
    """Evaluate on held-out prompts every this many train steps (0: never)."""
    eval_prompts: int = 64
    """Held-out prompts per evaluation."""

    @property
    def groups_per_step(self) -> int:
        return self.global_batch_size // self.n_samples_per_prompt


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything one run needs; each component receives only its own part."""

    run_dir: Path
    """Where metrics.jsonl, weights/, warmstart/ and (by default) checkpoints/ live."""
    num_steps: int
    """Train steps (optimizer updates) to run."""
    update_weights_interval: int
    """Push weights to the engines every this many train steps."""
    save_interval: int
    """Checkpoint every this many train steps (0: only at the end)."""
    num_engines: int
    """Embedded engines (CPU) or SGLang servers (GPU)."""
    engine_backend: str
    """'embedded' (any device) or 'sglang' (GPU servers)."""
    colocate: bool
    """Share all cores between trainer and engines instead of pinning them to disjoint cores."""
    trainer_cores: tuple[int, ...]
    """CPU cores of the trainer actor (empty: no pinning)."""
    rollout_cores: tuple[int, ...]
    """CPU cores of the engines (empty: no pinning)."""
    warmstart_steps: int
    """Supervised warm-start steps for the built-in tasks (0: start from the random model)."""
    seed: int
    """Run seed (data order, sampling, init)."""
    use_wandb: bool
    """Also log to Weights & Biases."""
    use_tensorboard: bool
    """Also log to TensorBoard."""
    model: ModelSpec
    """Architecture (read from --hf-checkpoint when given, else the tiny MoE)."""
    rollout: RolloutConfig
    data_worker: DataWorkerConfig
    router: RouterConfig
    engine: EngineConfig
    trainer: TrainerConfig
    supervisor: SupervisorConfig


def _loss_args(parser: argparse.ArgumentParser) -> None:
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


def _rollout_args(parser: argparse.ArgumentParser) -> None:
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


def _async_args(parser: argparse.ArgumentParser) -> None:
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


def _run_args(parser: argparse.ArgumentParser) -> None:
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
    g.add_argument("--num-engines", type=int, default=1, help="Rollout engines.")
    g.add_argument(
        "--engine-backend",
        choices=["embedded", "sglang"],
        default="embedded",
        help="Embedded engine (CPU/any device) or SGLang servers (GPU).",
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
    g.add_argument("--use-wandb", action="store_true", help="Log to Weights & Biases.")
    g.add_argument("--use-tensorboard", action="store_true", help="Log to TensorBoard.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_async.py",
        description="Asynchronous RL post-training (see README.md for the common flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _run_args(parser)
    _rollout_args(parser)
    _async_args(parser)
    _loss_args(parser)
    add_trainer_args(parser)
    add_router_args(parser, prefix="router-")
    return parser


def _cores(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    if text is None:
        return default
    try:
        return tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError as e:
        raise ValueError(f"core list {text!r} must be comma-separated integers") from e


def validate(args: argparse.Namespace) -> RunConfig:
    """Every cross-flag rule, in one place. Raises ValueError with an actionable message."""
    errors: list[str] = []
    n = args.n_samples_per_prompt
    if n < 1:
        errors.append("--n-samples-per-prompt must be >= 1")
    if args.rollout_batch_size < 1 or args.num_steps_per_rollout < 1:
        errors.append("--rollout-batch-size and --num-steps-per-rollout must be >= 1")
    gbs = args.global_batch_size
    if gbs is None and n >= 1 and args.num_steps_per_rollout >= 1:
        total = args.rollout_batch_size * n
        if total % args.num_steps_per_rollout:
            errors.append(
                f"rollout_batch_size x n = {total} is not divisible by --num-steps-per-rollout "
                f"{args.num_steps_per_rollout}; pass --global-batch-size explicitly"
            )
        gbs = total // max(1, args.num_steps_per_rollout)
    if gbs is not None and n >= 1 and gbs % n:
        errors.append(
            f"--global-batch-size {gbs} must be a multiple of --n-samples-per-prompt {n} "
            "(whole groups are trained together)"
        )
    if args.num_steps is not None and args.num_rollout is not None:
        errors.append("give either --num-steps or --num-rollout, not both")
    num_steps = args.num_steps
    if num_steps is None:
        num_steps = (args.num_rollout or 40) * args.num_steps_per_rollout
    if num_steps < 1:
        errors.append("--num-steps must be >= 1")
    if args.max_staleness < 0:
        errors.append("--max-staleness must be >= 0 (0 = synchronous)")
    if args.max_off_policy_steps is not None and args.max_off_policy_steps < 0:
        errors.append("--max-off-policy-steps must be >= 0")
    if args.max_off_policy_steps is not None and args.max_off_policy_steps < args.max_staleness:
        errors.append(
            f"--max-off-policy-steps {args.max_off_policy_steps} < --max-staleness "
            f"{args.max_staleness}: groups the budget admits would be dropped; raise it to at "
            "least the staleness bound or lower --max-staleness"
        )
    if args.update_weights_interval < 1:
        errors.append("--update-weights-interval must be >= 1")
    if args.update_weights_interval - 1 > args.max_staleness >= 0:
        errors.append(
            f"--update-weights-interval {args.update_weights_interval} needs --max-staleness >= "
            f"{args.update_weights_interval - 1}: engines serve a version that old between pushes, "
            "so the staleness budget would stall generation"
        )
    if args.eps_clip <= 0 or (args.eps_clip_high is not None and args.eps_clip_high <= 0):
        errors.append("--eps-clip and --eps-clip-high must be > 0")
    if args.eps_clip_c is not None and args.eps_clip_c <= 1:
        errors.append("--eps-clip-c (dual clip) must be > 1")
    rr = "r3" if args.use_rollout_routing_replay else args.routing_replay
    if args.colocate and (args.trainer_cores or args.rollout_cores):
        errors.append(
            "--colocate shares all cores; do not also pass --trainer-cores/--rollout-cores"
        )
    if args.num_engines < 1:
        errors.append("--num-engines must be >= 1")
    if args.eval_interval < 0 or args.eval_prompts < 0:
        errors.append("--eval-interval and --eval-prompts must be >= 0")
    if errors:
        raise ValueError("invalid flags:\n  - " + "\n  - ".join(errors))

    model = TINY_MOE
    if args.hf_checkpoint:
        from transformers import AutoConfig

        model = ModelSpec.from_hf_config(AutoConfig.from_pretrained(args.hf_checkpoint))
    if rr != "none" and not model.is_moe:
        raise ValueError(
            f"--routing-replay {rr} needs an MoE model, but {args.hf_checkpoint} is dense "
            f"({model.family}); drop the routing-replay flag"
        )

    ncpu = len(os.sched_getaffinity(0))
    half = max(1, ncpu // 2)
    colocate = args.colocate or ncpu < 2
    trainer_cores = () if colocate else _cores(args.trainer_cores, tuple(range(half)))
    rollout_cores = () if colocate else _cores(args.rollout_cores, tuple(range(half, ncpu)))
    if set(trainer_cores) & set(rollout_cores):
        raise ValueError(
            f"--trainer-cores {trainer_cores} and --rollout-cores {rollout_cores} overlap; give "
            "disjoint sets or use --colocate"
        )

    rollout = RolloutConfig(
        rollout_batch_size=args.rollout_batch_size,
        n_samples_per_prompt=n,
        global_batch_size=gbs,
        max_response_len=args.rollout_max_response_len,
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        advantage_estimator=args.advantage_estimator,
        dynamic_sampling=args.dynamic_sampling,
        prompt_data=args.prompt_data,
        input_key=args.input_key,
        label_key=args.label_key,
        apply_chat_template=args.apply_chat_template,
        strict_data=args.strict_data,
        custom_rm_path=args.custom_rm_path,
        eval_interval=args.eval_interval,
        eval_prompts=args.eval_prompts,
    )
    b = rollout.groups_per_step
    window = args.fifo_window if args.fifo_window is not None else 2 * b
    bound = worst_case_staleness(max_staleness=args.max_staleness, fifo_window=window,
                                 groups_per_step=b)  # fmt: skip
    if math.isinf(bound) and args.keep_old_actor:
        raise ValueError(
            "--keep-old-actor with --fifo-window inf has no staleness bound, so no finite number "
            "of weight snapshots suffices; use a finite --fifo-window"
        )
    if not (window >= 1):
        raise ValueError(f"--fifo-window {window} must be >= 1 (or inf)")
    data_worker = DataWorkerConfig(
        n_samples_per_prompt=n,
        groups_per_step=b,
        max_staleness=args.max_staleness,
        fifo_window=math.inf if math.isinf(window) else int(window),
        max_off_policy_steps=args.max_off_policy_steps,
        partial_rollout=PartialRolloutPolicy(args.partial_rollout),
        length_probe=not args.no_length_probe,
        default_expected_len=args.rollout_max_response_len,
        max_inflight=args.max_inflight,
    )
    loss_cfg = CompISConfig(
        staleness_method=args.staleness_correction_method,
        staleness_low=args.staleness_correction_low,
        staleness_high=args.staleness_correction_high,
        engine_method=args.engine_correction_method,
        engine_low=args.engine_correction_low,
        engine_high=args.engine_correction_high,
        eps_clip=args.eps_clip,
        eps_clip_high=args.eps_clip_high if args.eps_clip_high is not None else args.eps_clip,
        dual_clip_c=args.eps_clip_c,
        agg_mode=args.loss_agg_mode,
        loss_scale_factor=args.loss_scale_factor or float(args.rollout_max_response_len),
        denom=args.denom,
        diagnostics=not args.no_loss_diagnostics,
    )
    trainer = dataclasses.replace(
        trainer_config_from_args(args),
        loss=loss_cfg,
        temperature=args.rollout_temperature,
        max_snapshots=max(2, int(bound) + 1),
    )
    router = router_config_from_args(args, prefix="router-")
    engine = EngineConfig(
        dtype=args.engine_dtype,
        max_running_requests=args.engine_max_running_requests,
        seed=args.seed,
        weight_version="0",
        num_threads=1 if not colocate else None,
    )
    return RunConfig(
        run_dir=Path(args.run_dir),
        num_steps=num_steps,
        update_weights_interval=args.update_weights_interval,
        save_interval=args.save_interval,
        num_engines=args.num_engines,
        engine_backend=args.engine_backend,
        colocate=colocate,
        trainer_cores=trainer_cores,
        rollout_cores=rollout_cores,
        warmstart_steps=0 if args.prompt_data else args.warmstart_steps,
        seed=args.seed,
        use_wandb=args.use_wandb,
        use_tensorboard=args.use_tensorboard,
        model=model,
        rollout=rollout,
        data_worker=data_worker,
        router=router,
        engine=engine,
        trainer=trainer,
        supervisor=SupervisorConfig(
            restart_after_s=args.engine_restart_after,
            all_down_timeout_s=args.engine_down_timeout,
        ),
    )


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Parse flags and validate them; exits with the validation message on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return validate(args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
