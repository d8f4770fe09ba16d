"""`RunConfig`: the run-level settings of `train_async.py`, their flags, and the whole config.

Owns: `RunConfig` (the run-level settings plus one config object per component; every run-level
default lives here), `Derived` (a value the run chose for a flag the user left unset, and why),
`Environment` (facts from outside the flags), and the run's flag groups (`add_run_args`,
`add_placement_args`). Building and checking a `RunConfig` is
`slime_async.config`'s job. Imports only component config modules and contracts.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from clifields import add_flags, check_ranges, flag
from data_worker.config import DataWorkerConfig
from router.config import RouterConfig
from slime_async.config.engine_fleet import EngineFleetConfig
from slime_async.config.pipeline import PipelineConfig
from slime_async.config.supervision import SupervisorConfig
from slime_async.contracts.model import ModelSpec
from slime_async.engine.config import EngineConfig
from slime_async.metrics.config import LoggingConfig
from slime_async.rollout.config import RolloutConfig
from slime_async.trainer.config import TrainerConfig
from slime_async.weights.config import WeightSyncConfig

if TYPE_CHECKING:  # the checkpoint module imports torch
    from slime_async.trainer.checkpoint import LoadFacts
    from slime_async.trainer.megatron_ckpt import WeightsDir

DEFAULT_NUM_ROLLOUT = 200
"""Rollouts of a run that gives neither --num-steps nor --num-rollout."""
DEFAULT_WARMSTART_STEPS = 300
"""Warm-start steps of the embedded default run (`RunConfig.warmstart_steps`)."""


def parse_cores(text: str) -> tuple[int, ...]:
    """`--trainer-cores 0,1` -> (0, 1); a usage error names the flag's expected form."""
    try:
        return tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be comma-separated integers (e.g. 0,1)"
        ) from None


def _trainer_default(name: str) -> Any:
    return TrainerConfig.__dataclass_fields__[name].default


@dataclasses.dataclass(frozen=True, slots=True)
class Derived:
    """A value the run chose for a flag the user left unset, and why."""

    value: Any
    """The value used."""
    why: str
    """One line a user can check ("staleness bound 4 + the current version")."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Environment:
    """Facts from outside the flags that validation needs (gathered by `read_environment`)."""

    model: ModelSpec
    """Architecture: read from --hf-checkpoint, else the tiny MoE."""
    cpus: tuple[int, ...]
    """CPU cores this process may run on."""
    ray_address: str | None = None
    """Ray cluster to join (`--ray-address`, else `RAY_ADDRESS`); None: start a local one."""
    auth_token: str | None = dataclasses.field(default=None, repr=False)
    """The run's admin key (`SLIME_ASYNC_AUTH_TOKEN` or `--auth-token-file`), if any."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """The run's data-plane key (`SLIME_ASYNC_API_KEY` or `--api-key-file`), if any."""
    converted_checkpoint: str | None = None
    """HF directory converted from the .gguf file that --hf-checkpoint names (None: no GGUF)."""
    load: LoadFacts | None = None
    """What --load holds (None: no --load)."""
    ref_load: WeightsDir | None = None
    """What --ref-load holds: an HF directory or a Megatron torch_dist checkpoint (None: no
    --ref-load)."""
    cpu_bf16: str | None = None
    """The CPU flag that makes bf16 matmuls native here (`hardware.cpu_bf16_feature`), or None."""
    cxx: str | None = None
    """The C++ compiler torch's Inductor would run here (`trainer.fused.compiler`), or None."""
    memory_bytes: int | None = None
    """This node's physical memory (None: not checked)."""
    gpu_memory_bytes: tuple[int, ...] = ()
    """Total memory of each CUDA device of this node (`hardware.gpu_memory_bytes`; empty: none)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything one run needs; each component receives only its own part. The run-level
    fields are the `run` and `placement` flag groups; a component's part has flags of its own."""

    run_dir: Path = flag(Path("runs/default"), parse=Path)
    """Run directory: metrics.jsonl, weights/, warmstart/, config.json and (by default)
    checkpoints/."""
    num_steps: int = flag(derived="--num-rollout x --num-steps-per-rollout", ge=1)
    """Train steps (optimizer updates) to run."""
    num_rollout: int | None = flag(
        None,
        derived=f"{DEFAULT_NUM_ROLLOUT} unless --num-steps or --num-epoch is given",
        ge=1,
    )
    """slime-style: rollouts to run (--num-steps = this x --num-steps-per-rollout)."""
    num_epoch: int | None = flag(None, ge=1)
    """slime's: passes over --prompt-data; with neither --num-rollout nor --num-steps,
    --num-rollout = this x (the file's rows // --rollout-batch-size), as in slime (which
    ignores it when --num-rollout is given: logged so here)."""
    update_weights_interval: int = flag(1, ge=1)
    """Push weights to the engines every this many train steps."""
    engine_sleep_level: int = flag(
        0, ge=0, le=2, derived="2 with --offload-rollout (--colocate, --offload), else 0"
    )
    """Put the engines to sleep during every train step (generation paused, in-flight samples
    continued after it, as across a weight push): 1 frees their KV and prefix caches, 2 also
    their weights (SGLang's release_memory_occupation), so a colocated run really releases
    the engines' memory while the trainer needs it; 0: engines keep generating while the
    trainer trains (asynchronous)."""
    save_interval: int = flag(0, ge=0, hint="0 = only at the end")
    """Checkpoint (--save) and HF export (--save-hf) every this many rollouts, slime's unit
    (this x --num-steps-per-rollout train steps); 0: only at the end."""
    save_debug_rollout_data: str | None = flag(None, metavar="PATH")
    """slime's: write what each step sampled and trained (prompts, responses as text and ids,
    rewards, per-token versions and log-probs, drops, the step's loss metrics) to PATH, a
    template with {rollout_id} (the train step) or a directory of <rollout_id>.json files:
    JSON with a checksum, written atomically, never pickled"""
    load_debug_rollout_data: str | None = flag(None, metavar="PATH")
    """slime's: train from the dumps at PATH (as --save-debug-rollout-data wrote them) without
    engines: step k trains dump k, the same step bit for bit given the same flags and seed"""
    debug_rollout_only: bool = False
    """slime's: generate and score without a trainer (the engines serve --hf-checkpoint, or
    the built-in model); nothing is trained or pushed, --save-debug-rollout-data keeps the
    rollouts"""
    debug_train_only: bool | None = flag(
        None, derived="on with --load-debug-rollout-data or --loss-type sft_loss"
    )
    """slime's: train without engines, from --load-debug-rollout-data's dumps or, with
    --loss-type sft_loss, on --prompt-data's conversations"""
    ray_address: str | None = None
    """Ray cluster to join, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else a local Ray node
    with everything on loopback). Joined, the engines and the router listen on their nodes' IPs
    and need the run's keys. See docs/cluster.md."""
    auth_token_file: str | None = None
    """File holding the admin key of engines and router (SGLang's --admin-api-key; default:
    $SLIME_ASYNC_AUTH_TOKEN); never pass a key itself on the command line (nor is it ever
    recorded). The run keeps it: agents and plugins get the data-plane key only."""
    api_key_file: str | None = None
    """File holding the data-plane key of engines and router (SGLang's --api-key; default:
    $SLIME_ASYNC_API_KEY; with an admin key and neither, the run mints one)."""
    engines: EngineFleetConfig = flag(default_factory=EngineFleetConfig, cli=False)
    """The rollout engines: backend, count, URLs to attach (flags owned by the backends)."""
    colocate: bool = flag(False, derived="on only when this process may use a single core")
    """slime's: trainer and engines share the devices (all CPU cores; with --engine-backend
    sglang the SGLang servers start with --enable-memory-saver) and take turns: given, it
    means --offload-train --offload-rollout (engines released while the trainer trains, the
    trainer offloaded while the engines generate). Derived (one usable core), it shares the
    cores only."""
    offload: bool = False
    """slime's: --offload-train and --offload-rollout together."""
    offload_train: bool = flag(False, derived="on with --colocate or --offload")
    """slime's: offload the trainer (parameters, gradients, optimizer state; the newest
    version kept in a CPU weight cache, which the engines are given) while the engines
    generate; it onloads for each train step (docs/pipeline-scheduler.md#the-colocated-mode)."""
    offload_rollout: bool = flag(False, derived="on with --colocate or --offload")
    """slime's: release the engines' memory (SGLang's release_memory_occupation, at
    --engine-sleep-level) while the trainer trains; they resume before the weight push."""
    trainer_cores: tuple[int, ...] = flag(
        (), parse=parse_cores, derived="the first half of the usable cores"
    )
    """CPU cores of the trainer, comma-separated (empty: no pinning)."""
    rollout_cores: tuple[int, ...] = flag(
        (), parse=parse_cores, derived="the second half of the usable cores"
    )
    """CPU cores of the engines, comma-separated (empty: no pinning)."""
    behavior_role_cores: Literal["rollout", "all"] = "rollout"
    """Where the forward-only role (--behavior-forward role) runs: "rollout" (pinned to the
    engines' cores) or "all" (the trainer's and the engines' cores together: the OS runs its
    forwards on whichever side is idle; the role has one thread). docs/cpu.md#the-forward-only-role."""
    memory_limit_gib: float | None = flag(
        None,
        gt=0,
        derived="80% of this node's memory (a one-node run; a joined cluster: unchecked)",
    )
    """Memory the whole run may take on this node (every process: Ray, the driver, the router,
    the trainer, the role, the engines), in GiB. The start-up memory plan derives the trainer's
    micro-batch budget and recompute to fit it, or refuses with the numbers (docs/cpu.md#memory).
    Give it to run several runs side by side on one machine."""
    warmstart_steps: int = flag(
        DEFAULT_WARMSTART_STEPS,
        derived=f"{DEFAULT_WARMSTART_STEPS} for the embedded default run; 0 with --hf-checkpoint, "
        "--prompt-data or --load, where it cannot apply",
        ge=0,
    )
    """Supervised warm-start steps on the built-in tasks, cached in the run directory (0: start
    from the random model)."""
    seed: int = flag(_trainer_default("seed"), ge=0)
    """Run seed: model init, data order, sampling and the engines."""
    loggers: LoggingConfig = flag(default_factory=LoggingConfig, cli=False)
    """wandb and TensorBoard (`--use-wandb`, `--wandb-*`, `--use-tensorboard`: their own flag
    group)."""
    model: ModelSpec = flag(cli=False)
    """Architecture (read from --hf-checkpoint when given, else the tiny MoE)."""
    rollout: RolloutConfig = flag(cli=False)
    data_worker: DataWorkerConfig = flag(cli=False)
    router: RouterConfig = flag(cli=False)
    engine: EngineConfig = flag(cli=False)
    trainer: TrainerConfig = flag(cli=False)
    supervisor: SupervisorConfig = flag(cli=False)
    pipeline: PipelineConfig = flag(default_factory=PipelineConfig, cli=False)
    """Membership in a pipeline scheduler (docs/pipeline-scheduler.md); default: none."""
    weights: WeightSyncConfig = flag(default_factory=WeightSyncConfig, cli=False)
    """How weights reach the engines (`--update-weight-transport`, ...)."""
    derived: dict[str, Derived] = flag(default_factory=dict, cli=False)
    """Flag -> the value the run derived for it (the user left it unset) and why."""
    accepted: dict[str, str] = flag(default_factory=dict, cli=False)
    """A flag of slime's scripts that sets nothing here, as given -> why it is accepted (a
    model-shape flag equal to config.json's value, a run flag whose slime meaning holds here)."""
    flags: dict[str, Any] = flag(default_factory=dict, cli=False)
    """Every flag's value as parsed (recipe and command line; None where the run derived it):
    what `--config <run-dir>/config.json` replays."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.behavior_role_cores not in ("rollout", "all"):
            raise ValueError(
                f"behavior_role_cores={self.behavior_role_cores!r}; use 'rollout' (the engines' "
                "cores) or 'all' (the trainer's and the engines' cores)"
            )

    @property
    def rollout_seed(self) -> int:
        """Seed of the prompt order and the engines' sampling (`--rollout-seed`, else `--seed`)."""
        return self.rollout.seed_or(self.seed)


_PLACEMENT = (
    "colocate",
    "offload",
    "offload_train",
    "offload_rollout",
    "trainer_cores",
    "rollout_cores",
    "behavior_role_cores",
    "memory_limit_gib",
)
"""`RunConfig` fields of the `placement` flag group; the others are the `run` group."""


def run_default(name: str) -> Any:
    """The `RunConfig` default of field `name` (the one place it is written)."""
    return RunConfig.__dataclass_fields__[name].default


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The run's own flags: one per `RunConfig` field (defaults from `RunConfig`)."""
    add_flags(parser, RunConfig, group="run", exclude=_PLACEMENT)


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """Which CPU cores the trainer and the engines run on, and the memory the run may take."""
    add_flags(parser, RunConfig, group="placement", only=_PLACEMENT)
