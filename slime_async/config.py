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
from slime_async.args import add_async_args, add_loss_args, add_rollout_args, add_run_args
from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.engine.backends import EngineFleetConfig
from slime_async.engine.config import EngineConfig
from slime_async.rollout.config import RolloutConfig
from slime_async.supervisor import SupervisorConfig
from slime_async.trainer.config import TrainerConfig, add_trainer_args, trainer_config_from_args


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
    engines: EngineFleetConfig
    """The rollout engines: backend, count, URLs to attach."""
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_async.py",
        description="Asynchronous RL post-training (see README.md for the common flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_run_args(parser)
    EngineFleetConfig.add_args(parser)
    add_rollout_args(parser)
    add_async_args(parser)
    add_loss_args(parser)
    add_trainer_args(parser)
    add_router_args(parser, prefix="router-")
    # Unset means "the default for this kind of run": on for the embedded default (tiny MoE,
    # built-in tasks), off for a user's model/data. Both are documented in README and --help.
    parser.set_defaults(keep_old_actor=None, routing_replay=None, micro_batch_size=None)
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
    args = argparse.Namespace(**vars(args))  # resolving defaults never touches the caller's
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
        num_steps = (args.num_rollout or 200) * args.num_steps_per_rollout
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
    embedded = args.hf_checkpoint is None and args.prompt_data is None
    if args.keep_old_actor is None:  # CompIS's r2/r3 split needs version-j snapshots
        args.keep_old_actor = embedded
    if args.routing_replay is None:
        args.routing_replay = "r3" if embedded else "none"
    if args.micro_batch_size is None:  # tiny model on CPU: fewer, larger passes are faster
        args.micro_batch_size = 16 if embedded else TrainerConfig().micro_batch_size
    rr = "r3" if args.use_rollout_routing_replay else args.routing_replay
    if args.colocate and (args.trainer_cores or args.rollout_cores):
        errors.append(
            "--colocate shares all cores; do not also pass --trainer-cores/--rollout-cores"
        )
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
    if args.max_off_policy_steps is not None:  # older groups are dropped before training
        bound = min(bound, args.max_off_policy_steps)
    if math.isinf(bound) and args.keep_old_actor:
        raise ValueError(
            "--keep-old-actor with --fifo-window inf has no staleness bound, so no finite number "
            "of weight snapshots suffices; use a finite --fifo-window or --max-off-policy-steps"
        )
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
        engines=EngineFleetConfig.from_args(args),
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
