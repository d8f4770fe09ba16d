"""The command line of `train_async.py`: the parser, what a run derives, and every rule that spans
components.

Owns: `build_parser` (one flag group per component, each from the module of its config
dataclass; errors are one message and a hint, an unknown slime flag answered from
`slime_flags`), `read_environment` (the only I/O: the model's config from --hf-checkpoint, what
--load's directory holds, the usable CPU cores), `validate` (pure: flags + environment ->
`RunConfig`) and `parse_config`. The rules about what a run starts from and writes (`--load`,
`--save`, `--save-hf`, warm start) are `slime_async.config.run_paths`'; the derivation bookkeeping
(`Flags`) is `slime_async.config.derive`'s.

Each component's config dataclass owns its flags (`add_<component>_args` /
`<component>_config_from_args`, every flag default read from the dataclass) and the rules among
its own fields. This module checks only rules across components, and derives the settings whose
right value depends on the run: its kind (the embedded default or a user's model/data), its
staleness bound, the machine. Such a flag defaults to None; validation fills it only when the user
left it unset, and records the value and the reason in `RunConfig.derived` (logged once at
start-up, saved in `run_dir/config.json`). A flag the user set is never changed: if it contradicts
another setting, validation fails with a sentence naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from clifields import HelpFormatter, range_errors
from data_worker.budget import snapshot_count, staleness_bound
from data_worker.config import DataWorkerConfig, add_data_worker_args, data_worker_config_from_args
from loss import add_loss_args, loss_settings_from_args, resolve_loss_spec
from router.config import add_router_args, load_auth_token, router_config_from_args
from slime_async import startup
from slime_async.config import hardware, memory_plan
from slime_async.config.derive import Flags, raise_all
from slime_async.config.recipe import add_config_arg, apply_config_file, config_json, derived_lines
from slime_async.config.run_config import (
    DEFAULT_NUM_ROLLOUT,
    Derived,
    Environment,
    RunConfig,
    add_placement_args,
    add_run_args,
)
from slime_async.config.run_paths import (
    check_batch_shape,
    check_resume,
    derive_save_hf,
    derive_warmstart,
    resume_from,
)
from slime_async.config.slime_flags import explain_unrecognized
from slime_async.config.supervision import add_supervisor_args, supervisor_config_from_args
from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.engine.backends import EngineFleetConfig, get_engine_backend
from slime_async.engine.backends.config import split_sglang_args
from slime_async.engine.config import (
    EngineConfig,
    add_engine_run_args,
    engine_run_config_from_args,
)
from slime_async.host import ray_address
from slime_async.metrics.config import (
    add_logging_args,
    logging_config_from_args,
    refused_secret_flags,
)
from slime_async.rollout.config import RolloutConfig, add_rollout_args, rollout_config_from_args
from slime_async.trainer.config import (
    REAL_MODEL_LR,
    REAL_MODEL_LR_WARN,
    TrainerConfig,
    add_trainer_args,
    run_kind_defaults,
    trainer_config_from_args,
)
from slime_async.weights.config import add_weight_sync_args, weight_sync_config_from_args

log = logging.getLogger(__name__)

__all__ = [
    "Environment",
    "RunConfig",
    "build_parser",
    "parse_config",
    "validate",
]


class Parser(argparse.ArgumentParser):
    """argparse with short errors: the message and one hint line, no usage block, exit 2.
    Unrecognized slime flags are answered from `slime_flags.NOT_HERE`."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            message = explain_unrecognized(message[len(prefix) :].split())
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `train_async.py` parser: one flag group per component, each from its own module.
    No abbreviations: a slime flag that prefixes one of ours must not silently become ours."""
    parser = Parser(
        prog="train_async.py",
        allow_abbrev=False,
        description="Asynchronous RL post-training (README.md; every flag below comes from a "
        "config dataclass field, its help from the field docstring). "
        "Defaults that depend on the run are derived at start-up, logged as 'derived: ...' and "
        "saved in <run-dir>/config.json.",
        formatter_class=HelpFormatter,
    )
    add_config_arg(parser)
    add_run_args(parser)
    add_placement_args(parser)
    EngineFleetConfig.add_args(parser)
    add_rollout_args(parser)
    add_data_worker_args(parser)
    add_loss_args(parser)
    add_trainer_args(parser)
    add_engine_run_args(parser)
    add_supervisor_args(parser)
    add_weight_sync_args(parser)
    add_logging_args(parser)
    add_router_args(parser, prefix="router-")
    return parser


def read_environment(args: argparse.Namespace) -> Environment:
    """The I/O validation needs: the model's config (from --hf-checkpoint) and the usable cores."""
    model = TINY_MOE
    converted = None
    if args.hf_checkpoint:
        from transformers import AutoConfig

        from slime_async.tools.convert_gguf import converted_checkpoint

        try:  # a .gguf file is converted once into the run directory
            converted = converted_checkpoint(
                args.hf_checkpoint, Path(args.run_dir) / "hf_from_gguf", say=startup.say
            )
        except (FileNotFoundError, ImportError) as e:
            raise ValueError(str(e)) from None
        try:
            hf = AutoConfig.from_pretrained(str(converted or args.hf_checkpoint))
        except (OSError, ValueError) as e:
            raise ValueError(
                f"--hf-checkpoint {args.hf_checkpoint}: cannot read its config.json ({e}); give "
                "a local Hugging Face model directory"
            ) from None
        try:
            model = ModelSpec.from_hf_config(hf)
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"--hf-checkpoint {args.hf_checkpoint}: cannot train this model: "
                f"{e.args[0] if e.args else e}"
            ) from None

    load = None
    if args.load:  # read here, so that every refusal about it comes before anything starts
        from slime_async.trainer.checkpoint import inspect_load

        load = inspect_load(Path(args.load))
    return Environment(
        model=model,
        cpus=tuple(sorted(os.sched_getaffinity(0))),
        ray_address=ray_address(args.ray_address),
        auth_token=load_auth_token(args.auth_token_file),
        converted_checkpoint=None if converted is None else str(converted),
        load=load,
        cpu_bf16=hardware.cpu_bf16_feature(),
        memory_bytes=hardware.node_memory_bytes(),
    )


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Parse flags, read the environment, validate; exits with the message on bad input."""
    parser = build_parser()
    argv, sglang_args = split_sglang_args(sys.argv[1:] if argv is None else list(argv))
    if secrets := refused_secret_flags(argv):  # before argparse, which would echo the value
        parser.error("; ".join(secrets))
    pre, _ = parser.parse_known_args(argv)  # --config first: its values become the defaults
    try:
        if pre.config:
            apply_config_file(parser, pre.config)
    except ValueError as e:
        parser.error(str(e))
    args = parser.parse_args(argv)
    args.sglang_args = sglang_args
    try:
        cfg = validate(args, read_environment(args))
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
    if args.dry_run:
        for line in derived_lines(cfg):
            print(line, file=sys.stderr)
        print(config_json(cfg))
        raise SystemExit(0)
    return cfg


def _lora_engines(
    f: Flags, trainer: TrainerConfig, model: ModelSpec, engine: EngineConfig
) -> EngineConfig:
    """A LoRA run (`--lora-rank` > 0): the engines serve the run's adapter over the base, so
    they start with LoRA on, sized to the trainer's adapter; the rules only LoRA has."""
    a = f.args
    mlp = [
        m for m in trainer.lora_target_modules if m not in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    if model.is_moe and mlp:
        raise ValueError(
            f"--lora-target-modules {' '.join(mlp)}: this model's MLPs are routed experts, which "
            "take no adapter; use --lora-target-modules q_proj k_proj v_proj o_proj"
        )
    fleet = EngineFleetConfig.from_args(a)
    if not fleet.needs.versioned_adapters:
        raise ValueError(
            f"--lora-rank pushes each adapter version in place (/load_lora_adapter with "
            f"weight_version), which --engine-backend {fleet.backend} does not do; use the "
            "embedded engines, or --lora-rank 0 (full-weight pushes)"
        )
    distributed = not f.unset("update_weight_transport") and a.update_weight_transport != "disk"
    if distributed and not fleet.needs.distributed_adapters:
        raise ValueError(
            "--update-weight-transport distributed with --lora-rank broadcasts the adapter over "
            "the weight group for the engines to stage and activate (/update_weights_from_"
            f"distributed with lora_name), which --engine-backend {fleet.backend} does not do; "
            "use --update-weight-transport disk (or leave it unset)"
        )
    return dataclasses.replace(
        engine,
        enable_lora=True,
        max_lora_rank=trainer.lora_rank,
        lora_target_modules=trainer.lora_target_modules,
        max_loaded_loras=1,
    )


def validate(args: argparse.Namespace, env: Environment) -> RunConfig:
    """Flags + environment -> `RunConfig`: every cross-component rule, without I/O, then the
    start-up memory check (`_fit_memory`).

    Raises ValueError with a sentence naming the flag and the fix.
    """
    return _fit_memory(args, env, _validate(args, env))


def _memory_parts(cfg: RunConfig) -> dict[str, int]:
    """Bytes each role of `cfg` holds on this node (`memory_plan.role_bytes`)."""
    t = cfg.trainer
    snaps = t.max_snapshots if t.keep_old_actor else 0
    role = t.behavior_forward == "role" and t.keep_old_actor
    lay = (t.tensor_model_parallel_size, t.pipeline_model_parallel_size)
    dp = max(1, t.world_size // (lay[0] * lay[1]))
    shape = memory_plan.RunShape(
        params=memory_plan.param_count(cfg.model),
        trainer_ranks=t.world_size,
        tp_pp=lay[0] * lay[1],
        dp=dp,
        distributed_optimizer=t.use_distributed_optimizer is not False and dp > 1,
        bf16=t.bf16,
        trainer_snapshots=0 if role else snaps,
        role_versions=snaps if role else None,
        engines=cfg.engines.num_engines if cfg.engines.backend == "embedded" else 0,
        engine_bytes=2 if cfg.engine.dtype == "bf16" else 4,
        adapter_params=_adapter_numel(cfg),
    )
    return memory_plan.role_bytes(shape)


def _adapter_numel(cfg: RunConfig) -> int:
    """Numbers in the run's LoRA adapter (0 without `--lora-rank`)."""
    t = cfg.trainer
    if not t.lora_rank:
        return 0
    from slime_async.contracts.adapter import LoraSpec, adapter_numel

    spec = LoraSpec(rank=t.lora_rank, alpha=t.lora_alpha, targets=tuple(t.lora_target_modules))
    return adapter_numel(cfg.model, spec)


def _fit_memory(args: argparse.Namespace, env: Environment, cfg: RunConfig) -> RunConfig:
    """A one-node run whose roles would not fit in the node's memory: with a derived
    `--behavior-forward role`, derive `trainer` instead when that fits (the snapshots live in
    the trainer, no second model); otherwise refuse, with the numbers and the fix."""
    mem = env.memory_bytes
    if mem is None or env.ray_address is not None:  # a joined cluster: nodes of their own
        return cfg
    parts = _memory_parts(cfg)
    if memory_plan.fits(parts, mem):
        return cfg
    why = memory_plan.describe(parts, mem)
    if cfg.trainer.behavior_forward == "role" and "--behavior-forward" in cfg.derived:
        alt = _validate(argparse.Namespace(**{**vars(args), "behavior_forward": "trainer"}), env)
        alt_parts = _memory_parts(alt)
        if memory_plan.fits(alt_parts, mem):
            alt.derived["--behavior-forward"] = Derived(
                "trainer",
                f"the forward-only role would not fit ({why}); with the snapshots in the "
                f"trainer: {memory_plan.describe(alt_parts, mem)}",
            )
            return alt
    raise ValueError(
        f"this run would not fit in this node's memory: {why}. Fix: --bf16 (half the weights), "
        "fewer --max-snapshots or --no-keep-old-actor, fewer --num-engines, --engine-dtype "
        "bf16, or a node with more memory (docs/cpu.md#memory)"
    )


def _validate(args: argparse.Namespace, env: Environment) -> RunConfig:
    """`validate` without the memory check."""
    f = Flags(args)
    a = f.args
    flags = {k: v for k, v in vars(args).items() if k not in ("sglang_args", "config", "dry_run")}
    if env.converted_checkpoint is not None:  # the same weights, in the form the trainer reads
        a.hf_checkpoint = env.converted_checkpoint
        f.note(
            "hf_checkpoint", a.hf_checkpoint, f"converted from the GGUF file {args.hf_checkpoint}"
        )
    embedded = a.hf_checkpoint is None and a.prompt_data is None and a.prompt_source is None
    raise_all(_run_errors(a))
    rollout = rollout_config_from_args(a)
    if a.global_batch_size is None:
        f.note(
            "global_batch_size",
            rollout.global_batch_size,
            "rollout_batch_size x n_samples_per_prompt / num_steps_per_rollout",
        )
    _note_eval(f, rollout)
    _derive_num_steps(f, rollout)
    b = rollout.groups_per_step
    if (per := a.sglang_server_concurrency) is not None:  # slime's per-server concurrency
        n = EngineFleetConfig.from_args(a).num_engines
        if not f.unset("max_inflight") and a.max_inflight != per * n:
            raise ValueError(
                f"--max-inflight {a.max_inflight} contradicts --sglang-server-concurrency {per} x "
                f"{n} engines = {per * n} concurrent generate calls: give one of the two"
            )
        if f.unset("max_inflight"):
            f.fill("max_inflight", per * n, f"--sglang-server-concurrency {per} x {n} engines")
    data_worker = data_worker_config_from_args(
        a,
        n_samples_per_prompt=rollout.n_samples_per_prompt,
        groups_per_step=b,
        default_expected_len=rollout.max_response_len,
    )
    if f.unset("max_inflight"):
        f.note(
            "max_inflight", data_worker.max_inflight, "the default (no --sglang-server-concurrency)"
        )
    if a.fifo_window is None:
        f.note("fifo_window", data_worker.fifo_window, f"2 x groups per step (B = {b})")
    raise_all(_schedule_errors(a, data_worker))
    data_worker = _derive_off_policy_drop(f, data_worker)
    loss = loss_settings_from_args(a, default_loss_scale_factor=float(rollout.max_response_len))
    for flag, value, why in loss.derived:
        f.derived[flag] = Derived(value, why)
    _derive_trainer(f, data_worker, embedded=embedded, loss_name=loss.loss.name)
    _derive_bf16(f, env, embedded=embedded)
    derive_save_hf(f, embedded=embedded, gguf=args.hf_checkpoint)
    trainer = trainer_config_from_args(a)
    _check_model(trainer, env.model, hf_checkpoint=a.hf_checkpoint)
    trainer = dataclasses.replace(
        trainer,
        loss=loss.loss,
        temperature=rollout.temperature,
        hf_source=a.hf_checkpoint,
        load=resume_from(f, env, embedded=embedded),
    )
    check_resume(a, env, trainer)
    engines = EngineFleetConfig.from_args(a)
    if f.unset("num_engines"):
        why = "one per --engine-urls URL" if engines.urls else "the default"
        if a.rollout_num_gpus is not None:
            why = (
                f"--rollout-num-gpus {a.rollout_num_gpus} / --rollout-num-gpus-per-engine "
                f"{engines.gpus_per_engine}"
            )
        f.note("num_engines", engines.num_engines, why)
    if a.rollout_num_gpus is None:
        f.note(
            "rollout_num_gpus",
            engines.rollout_num_gpus,
            "--num-engines x --rollout-num-gpus-per-engine",
        )
    colocate, trainer_cores, rollout_cores = _placement(f, env)
    if f.unset("router_cache_salt"):
        if engines.backend in ("sglang", "external"):
            why = (
                "SGLang engines share cached prefixes across weight versions unless each "
                "request's extra_key changes with the push (docs/weight-sync.md)"
            )
            f.fill("router_cache_salt", True, why)
        else:
            why = "the embedded engine keys its prefix cache by weight version itself"
            f.fill("router_cache_salt", False, why)
    router, token = _shared_token(a, env)
    derive_warmstart(f, embedded=embedded, resume=trainer.load is not None)
    engine = engine_run_config_from_args(
        a,
        seed=rollout.seed_or(a.seed),
        num_threads=None if colocate else 1,
    )
    if trainer.lora_rank:
        engine = _lora_engines(f, trainer, env.model, engine)
    if f.unset("update_weight_transport"):
        if trainer.lora_rank:
            f.fill(
                "update_weight_transport",
                "disk",
                "LoRA: each push is the adapter's PEFT directory, loaded by name (docs/lora.md)",
            )
        elif not engines.needs.owns_processes:
            f.fill(
                "update_weight_transport",
                "disk",
                "--engine-backend external: servers the "
                "run does not own come back on their own weights, and the router replays the "
                "newest disk load on them before re-admission",
            )
        else:
            f.fill(
                "update_weight_transport",
                "distributed",
                "no shared filesystem needed (docs/weight-sync.md)",
            )
    _derive_weight_dtype(f, engines.backend, engine.dtype, trainer)
    cfg = RunConfig(
        run_dir=Path(a.run_dir),
        ray_address=env.ray_address,
        auth_token_file=a.auth_token_file,
        num_steps=a.num_steps,
        update_weights_interval=a.update_weights_interval,
        save_interval=a.save_interval,
        engines=engines,
        colocate=colocate,
        trainer_cores=trainer_cores,
        rollout_cores=rollout_cores,
        warmstart_steps=a.warmstart_steps,
        seed=a.seed,
        loggers=logging_config_from_args(a),
        model=env.model,
        rollout=rollout,
        data_worker=data_worker,
        router=router,
        engine=dataclasses.replace(engine, auth_token=token),
        trainer=trainer,
        supervisor=supervisor_config_from_args(a),
        weights=weight_sync_config_from_args(f.args),
        derived=f.derived,
        flags=flags,
    )
    if trainer.load is not None and env.load is not None:
        check_batch_shape(env.load.batch_shape, cfg, where=str(a.load))
    return cfg


def _shared_token(a: argparse.Namespace, env: Environment) -> tuple[Any, str | None]:
    """(router config, the run's shared token). One token guards the router and every engine
    (the router presents it to them): `$SLIME_ASYNC_AUTH_TOKEN` / `--auth-token-file`, or a
    deprecated `--router-auth-token`. Joining a cluster puts servers on node IPs, so it needs one."""
    flag = a.router_auth_token
    if flag and env.auth_token and flag != env.auth_token:
        raise ValueError(
            "--router-auth-token differs from the run's shared token ($SLIME_ASYNC_AUTH_TOKEN / "
            "--auth-token-file); router and engines use one token: drop --router-auth-token"
        )
    token = flag or env.auth_token
    if env.ray_address is not None and not token:
        raise ValueError(
            f"joining the Ray cluster at {env.ray_address} puts the engines and the router on "
            "their nodes' IPs, which needs the run's shared token: export "
            "SLIME_ASYNC_AUTH_TOKEN=<token> or pass --auth-token-file PATH (never the token "
            "itself on the command line)"
        )
    a = argparse.Namespace(**{**vars(a), "router_auth_token": token})
    return router_config_from_args(a, prefix="router-"), token


def _run_errors(a: argparse.Namespace) -> list[str]:
    """Rules among the run's own flags (and router flags the run itself sets)."""
    errors = []
    if a.num_steps is not None and a.num_rollout is not None:
        errors.append("give either --num-steps or --num-rollout, not both")
    errors += range_errors(RunConfig, a)  # before anything is derived from them
    if a.router_worker_urls:  # the launcher registers exactly the engines it starts
        errors.append(
            "--router-worker-urls cannot apply to train_async.py: the run registers its engines "
            "with its router itself; drop the flag (to attach servers that are already running, "
            "use --engine-backend external --engine-urls URL,...)"
        )
    return errors


def _note_eval(f: Flags, rollout: RolloutConfig) -> None:
    """Record the eval settings `RolloutConfig` resolved for unset flags: the cadence (0 when
    the run has no eval set: said once, here) and, when it evaluates, the rollout settings the
    eval samples inherit."""
    if f.unset("eval_interval"):
        if rollout.eval_interval:
            f.note("eval_interval", rollout.eval_interval, "default: the run has an eval set")
        else:
            f.note(
                "eval_interval",
                0,
                f"no eval set: {rollout.no_eval_set_reason}; give --eval-prompt-data NAME PATH "
                "to evaluate",
            )
    if not rollout.eval_interval:
        return
    inherited = {
        "eval_max_response_len": "--rollout-max-response-len",
        "eval_temperature": "--rollout-temperature",
        "eval_top_p": "--rollout-top-p",
    }
    if rollout.eval_prompt_data:
        inherited |= {"eval_input_key": "--input-key", "eval_label_key": "--label-key"}
    for dest, source in inherited.items():
        if f.unset(dest):
            f.note(dest, getattr(rollout, dest), f"{source}, as training")


def _derive_num_steps(f: Flags, rollout: RolloutConfig) -> None:
    if not f.unset("num_steps"):
        return
    a = f.args
    rollouts = DEFAULT_NUM_ROLLOUT if a.num_rollout is None else a.num_rollout
    f.fill(
        "num_steps",
        rollouts * rollout.num_steps_per_rollout,
        f"--num-rollout {rollouts} x --num-steps-per-rollout {rollout.num_steps_per_rollout}",
    )


def _schedule_errors(a: argparse.Namespace, dw: DataWorkerConfig) -> list[str]:
    """Rules between the weight-push cadence and the data worker's staleness settings."""
    errors = []
    s, m = dw.max_staleness, dw.max_off_policy_steps
    if m is not None and m < s:
        errors.append(
            f"--max-off-policy-steps {m} < --max-staleness {s}: groups the budget admits would "
            "be dropped; raise it to at least the staleness bound or lower --max-staleness"
        )
    if a.update_weights_interval - 1 > s:
        errors.append(
            f"--update-weights-interval {a.update_weights_interval} needs --max-staleness >= "
            f"{a.update_weights_interval - 1}: engines serve a version that old between pushes, "
            "so the staleness budget would stall generation"
        )
    return errors


def _derive_off_policy_drop(f: Flags, dw: DataWorkerConfig) -> DataWorkerConfig:
    """Unset `--max-off-policy-steps`: the staleness bound S + ceil((W - 1) / B)
    (`staleness_bound`; the push interval adds nothing: the budget counts against the pushed
    version), so the run never trains a group past the bound it states. The budget keeps every
    group inside it while the engines serve the pushed weights; a group sampled on older ones
    (the backstop: a replacement engine is held out of the router until it has the fleet's
    weights) is dropped and counted instead of trained. Unbounded window: nothing to derive."""
    if not f.unset("max_off_policy_steps"):
        return dw
    bound = staleness_bound(
        max_staleness=dw.max_staleness,
        fifo_window=dw.fifo_window,
        groups_per_step=dw.groups_per_step,
    )
    if math.isinf(bound):
        return dw
    steps = int(bound)
    f.fill(
        "max_off_policy_steps",
        steps,
        f"the staleness bound S {dw.max_staleness} + ceil((W {dw.fifo_window:g} - 1) / B "
        f"{dw.groups_per_step})"
        + (
            f" (--update-weights-interval {f.args.update_weights_interval} adds none: the budget "
            "counts against the pushed version)"
            if f.args.update_weights_interval > 1
            else ""
        )
        + ": a group sampled on weights older than the pushed ones is dropped, not trained",
    )
    return dataclasses.replace(dw, max_off_policy_steps=steps)


def _derive_trainer(f: Flags, dw: DataWorkerConfig, *, embedded: bool, loss_name: str) -> None:
    """Run-kind defaults (see `trainer.config.EMBEDDED_RUN`) and the snapshot count. Snapshots
    are kept by default only for a loss that reads π_j^Meg (its `LossNeeds`)."""
    a = f.args
    kind = (
        "the embedded default run"
        if embedded
        else "a run with --hf-checkpoint/--prompt-data/--prompt-source"
    )
    _derive_lr(f, embedded=embedded)
    reads_behavior = resolve_loss_spec(loss_name).needs.behavior_logprobs
    for dest, value in run_kind_defaults(embedded=embedded).items():
        aliased = dest == "routing_replay" and a.use_rollout_routing_replay
        if not f.unset(dest) or aliased:
            continue
        if dest == "keep_old_actor" and value and not reads_behavior:
            f.fill(dest, False, f"--loss {loss_name} does not read pi_j^Meg snapshots")
        else:
            f.fill(dest, value, f"default of {kind}")
    if f.unset("behavior_forward"):
        if a.keep_old_actor and reads_behavior and dw.max_staleness > 0:
            f.fill(
                "behavior_forward",
                "role",
                "an async run whose loss reads pi_j^Meg: the forward-only role computes it off "
                "the train step (docs/compis.md)"
                + (
                    "; under LoRA it holds the base once and an adapter per version"
                    if a.lora_rank
                    else ""
                ),
            )
        else:
            f.fill("behavior_forward", "trainer", "nothing to move off the train step")
    if not a.keep_old_actor:
        return  # no snapshots are kept, so --max-snapshots has nothing to size
    window = dict(
        max_staleness=dw.max_staleness,
        fifo_window=dw.fifo_window,
        groups_per_step=dw.groups_per_step,
    )
    bound = staleness_bound(**window, max_off_policy_steps=dw.max_off_policy_steps)
    if math.isinf(bound):
        raise ValueError(
            "--keep-old-actor with --fifo-window inf has no staleness bound, so no finite number "
            "of weight snapshots suffices; use a finite --fifo-window or --max-off-policy-steps, "
            "or --no-keep-old-actor"
        )
    b = int(bound)
    why = f"S {dw.max_staleness} + ceil((W {dw.fifo_window:g} - 1) / B {dw.groups_per_step})"
    if bound < staleness_bound(**window):
        why = f"--max-off-policy-steps {b}"
    # the trainer snapshots every version; the forward-only role only the pushed ones
    every = a.update_weights_interval if a.behavior_forward == "role" else 1
    need = int(snapshot_count(bound=b, versions_every=every))
    if every == 1:
        why = f"staleness bound {b} ({why}) + the current version"
    else:
        why = (
            f"staleness bound {b} ({why}), the role holding only versions pushed every "
            f"--update-weights-interval {every}: floor({b} / {every}) + 1 of them, + 1 off "
            "that grid (a resumed start or an early push)"
        )
    if f.unset("max_snapshots"):
        f.fill("max_snapshots", need, why)
    elif a.max_snapshots < need:
        raise ValueError(
            f"--max-snapshots {a.max_snapshots} is too few for --keep-old-actor: a trained token "
            f"can come from any of {need} versions ({why}); give --max-snapshots {need} or more "
            "(or drop the flag), or lower --max-staleness / --fifo-window"
        )


def _derive_weight_dtype(f: Flags, backend: str, engine_dtype: str, trainer: Any) -> None:
    """The dtype weights travel in: the engines' when known to be bf16 (half the bytes of
    fp32; the engine would round to bf16 the same way), the trainer's otherwise."""
    if not f.unset("update_weight_dtype"):
        return
    role_reads_disk = (
        f.args.update_weight_transport == "disk" and trainer.behavior_forward == "role"
    )
    if trainer.bf16:
        f.fill("update_weight_dtype", "bfloat16", "the trainer's parameters are bf16")
    elif backend == "embedded" and engine_dtype == "bf16" and not role_reads_disk:
        f.fill("update_weight_dtype", "bfloat16", "the engines serve bf16 (--engine-dtype bf16)")
    else:
        why = (
            "the forward-only role reads the disk exports as the trainer's weights"
            if role_reads_disk
            else "the trainer's dtype (the engines' is not known here)"
        )
        f.fill("update_weight_dtype", "float32", why)


def _derive_bf16(f: Flags, env: Environment, *, embedded: bool) -> None:
    """bf16 compute (fp32 main weights and gradient accumulation) for a run with a user's model
    on a CPU with native bf16 matmuls (AMX / AVX512_BF16); fp32 otherwise (docs/cpu.md)."""
    if not f.unset("bf16"):
        return
    if embedded:
        f.fill("bf16", False, "the embedded default run's tiny model trains in fp32")
    elif env.load is not None and env.load.version is not None:
        f.fill(
            "bf16",
            False,
            "a resumed run keeps fp32 unless told: give --bf16 if its checkpoint was saved so",
        )
    elif env.cpu_bf16:
        f.fill(
            "bf16",
            True,
            f"the CPU has {env.cpu_bf16}: bf16 matmuls, fp32 main weights and gradients",
        )
    else:
        f.fill("bf16", False, "the CPU has no AMX/AVX512_BF16 (bf16 would be emulated): fp32")


def _derive_lr(f: Flags, *, embedded: bool) -> None:
    """The learning rate by run kind; a user lr far above what RL on a pretrained model takes is
    kept, with a warning (it is the user's flag)."""
    if f.unset("lr"):
        if embedded:
            f.fill("lr", TrainerConfig().lr, "default of the embedded default run (tiny model)")
        else:
            f.fill(
                "lr",
                REAL_MODEL_LR,
                "default of a run with --hf-checkpoint/--prompt-data/"
                "--prompt-source: RL on a pretrained model",
            )
    elif not embedded and f.args.lr > REAL_MODEL_LR_WARN:
        log.warning(
            "--lr %g is far above what RL on a pretrained model takes (~%g): expect the policy "
            "entropy to collapse and the train-rollout log-prob gap to jump after one update",
            f.args.lr,
            REAL_MODEL_LR,
        )


def _check_model(trainer: TrainerConfig, model: ModelSpec, *, hf_checkpoint: str | None) -> None:
    """Rules between the trainer's settings and the model it trains."""
    replay = trainer.routing_replay.value
    if replay != "none" and not model.is_moe:
        raise ValueError(
            f"--routing-replay {replay} needs an MoE model, but {hf_checkpoint} is dense "
            f"({model.family}); drop the routing-replay flag"
        )


def _placement(f: Flags, env: Environment) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
    """(colocate, trainer cores, rollout cores) on the cores this process may use. On a joined
    cluster the roles run on other nodes: each pins cores of its own node at start-up
    (`slime_async.orchestrator.placement`), so none are derived from this machine."""
    a, cpus = f.args, env.cpus
    if env.ray_address is not None:
        if a.trainer_cores is not None or a.rollout_cores is not None:
            raise ValueError(
                "--trainer-cores/--rollout-cores name cores of this machine, but on a joined "
                "Ray cluster every role pins cores of its own node (split by the CPUs it "
                "reserves); drop them (or size --actor-num-cpus-per-rank / "
                "--rollout-num-cpus-per-engine)"
            )
        if f.unset("colocate"):
            f.fill("colocate", False, "joined Ray cluster: cores are pinned per node")
        return bool(a.colocate), (), ()
    given = {
        k: tuple(v)
        for k in ("trainer-cores", "rollout-cores")
        if (v := getattr(a, k.replace("-", "_"))) is not None
    }
    if a.colocate and get_engine_backend(a.engine_backend).needs.gpus_per_engine > 0:
        raise ValueError(
            "--colocate here shares CPU cores between trainer and engines; slime's --colocate "
            "(engines and trainer time-sharing the GPUs, with offload) is not implemented for "
            f"--engine-backend {a.engine_backend} (GPU engines); drop --colocate and give the "
            "engines their own GPUs"
        )
    if a.colocate and given:
        raise ValueError(
            "--colocate shares all cores; do not also pass --trainer-cores/--rollout-cores"
        )
    if f.unset("colocate"):
        if len(cpus) < 2 and given:
            raise ValueError(
                f"--trainer-cores/--rollout-cores need 2 or more CPU cores, but this process may "
                f"use only core {cpus[0]}; drop them (trainer and engines then share it)"
            )
        f.fill("colocate", len(cpus) < 2, f"{len(cpus)} usable CPU core(s): {list(cpus)}")
    if a.colocate:
        return True, (), ()
    half = max(1, len(cpus) // 2)
    defaults = {"trainer-cores": (cpus[:half], "first"), "rollout-cores": (cpus[half:], "second")}
    for flag, (cores, which) in defaults.items():
        if flag not in given:
            f.note(flag.replace("-", "_"), cores, f"{which} half of the usable cores {list(cpus)}")
            given[flag] = cores
        elif missing := sorted(set(given[flag]) - set(cpus)):
            raise ValueError(
                f"--{flag} names core(s) {missing} this process may not use (usable: "
                f"{list(cpus)}); pick cores from that set"
            )
    trainer, rollout = given["trainer-cores"], given["rollout-cores"]
    if set(trainer) & set(rollout):
        raise ValueError(
            f"--trainer-cores {trainer} and --rollout-cores {rollout} overlap; give disjoint sets "
            "or use --colocate"
        )
    return False, trainer, rollout
