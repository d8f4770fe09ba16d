"""The command line of `train_async.py`: the parser, the environment, and the entry point.

Owns: `build_parser` (one flag group per component, each from the module of its config
dataclass; errors are one message and a hint, an unknown slime flag answered from
`slime_flags`), `read_environment` (the only I/O: the model's config from --hf-checkpoint, what
--load's directory holds, the usable CPU cores), `validate` (pure: flags + environment ->
`RunConfig`) and `parse_config`. What a run derives and every rule across components are the
named rules of `slime_async.config.rules` (`RULES`, in their order); the rules about what a run
starts from and writes (`--load`, `--save`, `--save-hf`, warm start) are
`slime_async.config.run_paths`'; the derivation bookkeeping (`Flags`) is
`slime_async.config.derive`'s.

Each component's config dataclass owns its flags (`add_<component>_args` /
`<component>_config_from_args`, every flag default read from the dataclass) and the rules among
its own fields. The rules check only rules across components, and derive the settings whose
right value depends on the run: its kind (the embedded default or a user's model/data), its
staleness bound, the machine. Such a flag defaults to None; validation fills it only when the user
left it unset, and records the value and the reason in `RunConfig.derived` (logged once at
start-up, saved in `run_dir/config.json`). A flag the user set is never changed: if it contradicts
another setting, validation fails with a sentence naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from clifields import HelpFormatter
from data_worker.config import add_data_worker_args
from loss import add_loss_args
from router.config import add_router_args, load_api_key, load_auth_token
from slime_async import startup
from slime_async.config import hardware
from slime_async.config.engine_fleet import EngineFleetConfig, split_sglang_args
from slime_async.config.inputs import check_inputs
from slime_async.config.pipeline import add_pipeline_args
from slime_async.config.recipe import add_config_arg, apply_config_file, config_json, derived_lines
from slime_async.config.rules import derive
from slime_async.config.run_config import (
    Environment,
    RunConfig,
    add_placement_args,
    add_run_args,
)
from slime_async.config.script_flags import add_script_args
from slime_async.config.slime_flags import explain_unrecognized
from slime_async.config.supervision import add_supervisor_args
from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.engine.config import add_engine_run_args
from slime_async.host import ray_address, trim_heap
from slime_async.metrics.config import add_logging_args, refused_secret_flags
from slime_async.rollout.config import add_rollout_args
from slime_async.trainer.config import add_trainer_args
from slime_async.weights.config import add_weight_sync_args

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
    add_script_args(parser)
    add_engine_run_args(parser)
    add_supervisor_args(parser)
    add_pipeline_args(parser)
    add_weight_sync_args(parser)
    add_logging_args(parser)
    add_router_args(parser, prefix="router-")
    return parser


def read_environment(args: argparse.Namespace) -> Environment:
    """The I/O validation needs: every path the run reads checked (`inputs.check_inputs`), the
    model's config (from --hf-checkpoint), what --load and --ref-load hold, the usable cores."""
    ref_load = check_inputs(args)
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
        if converted is not None:
            trim_heap()  # the de-quantized tensors are written: their 1 GiB back to the node
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
        api_key=load_api_key(args.api_key_file),
        converted_checkpoint=None if converted is None else str(converted),
        load=load,
        ref_load=ref_load,
        cpu_bf16=hardware.cpu_bf16_feature(),
        cxx=hardware.cpp_compiler(),
        memory_bytes=hardware.node_memory_bytes(),
        gpu_memory_bytes=hardware.gpu_memory_bytes(),
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


def validate(args: argparse.Namespace, env: Environment) -> RunConfig:
    """Flags + environment -> `RunConfig`: every cross-component rule, without I/O, then the
    start-up memory check (the named rules of `slime_async.config.rules`, in their order).

    Raises ValueError with a sentence naming the flag and the fix.
    """
    return derive(args, env)
