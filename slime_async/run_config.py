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
from typing import Any

from data_worker.config import DataWorkerConfig
from router.config import AUTH_TOKEN_ENV, RouterConfig
from slime_async.contracts.model import ModelSpec
from slime_async.engine.backends.config import EngineFleetConfig
from slime_async.engine.config import EngineConfig
from slime_async.rollout.config import RolloutConfig
from slime_async.supervisor import SupervisorConfig
from slime_async.trainer.config import TrainerConfig
from slime_async.weights.config import WeightSyncConfig

DEFAULT_NUM_ROLLOUT = 200
"""Rollouts of a run that gives neither --num-steps nor --num-rollout."""


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
    """The run's shared token (`SLIME_ASYNC_AUTH_TOKEN` or `--auth-token-file`), if any."""
    converted_checkpoint: str | None = None
    """HF directory converted from the .gguf file that --hf-checkpoint names (None: no GGUF)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything one run needs; each component receives only its own part."""

    run_dir: Path = Path("runs/default")
    """Where metrics.jsonl, weights/, warmstart/ and (by default) checkpoints/ live."""
    num_steps: int
    """Train steps (optimizer updates) to run."""
    update_weights_interval: int = 1
    """Push weights to the engines every this many train steps."""
    save_interval: int = 0
    """Checkpoint every this many rollouts, slime's unit (= train steps with
    --num-steps-per-rollout 1) (0: only at the end)."""
    ray_address: str | None = None
    """Ray cluster joined (engines and router then bind their nodes' IPs, with the token);
    None: a local Ray node, everything on loopback."""
    auth_token_file: str | None = None
    """File the shared token was read from (`--auth-token-file`); the token itself is never
    recorded."""
    engines: EngineFleetConfig = dataclasses.field(default_factory=EngineFleetConfig)
    """The rollout engines: backend, count, URLs to attach (flags owned by the backends)."""
    colocate: bool = False
    """Share all cores between trainer and engines instead of pinning them to disjoint cores."""
    trainer_cores: tuple[int, ...] = ()
    """CPU cores of the trainer actor (empty: no pinning)."""
    rollout_cores: tuple[int, ...] = ()
    """CPU cores of the engines (empty: no pinning)."""
    warmstart_steps: int = 300
    """Supervised warm-start steps of the embedded default run (0: start from the random model)."""
    seed: int
    """Run seed (data order, sampling, init); the trainer's `--seed`."""
    use_wandb: bool = False
    """Also log to Weights & Biases."""
    use_tensorboard: bool = False
    """Also log to TensorBoard."""
    model: ModelSpec
    """Architecture (read from --hf-checkpoint when given, else the tiny MoE)."""
    rollout: RolloutConfig
    data_worker: DataWorkerConfig
    router: RouterConfig
    engine: EngineConfig
    trainer: TrainerConfig
    supervisor: SupervisorConfig
    weights: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
    """How weights reach the engines (`--update-weight-transport`, ...)."""
    derived: dict[str, Derived] = dataclasses.field(default_factory=dict)
    """Flag -> the value the run derived for it (the user left it unset) and why."""

    @property
    def rollout_seed(self) -> int:
        """Seed of the prompt order and the engines' sampling (`--rollout-seed`, else `--seed`)."""
        return self.rollout.seed_or(self.seed)


def run_default(name: str) -> Any:
    """The `RunConfig` default of field `name` (the one place it is written)."""
    return RunConfig.__dataclass_fields__[name].default


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The run's own flags (defaults from `RunConfig`)."""
    g = parser.add_argument_group("run")
    g.add_argument(
        "--run-dir",
        default=str(run_default("run_dir")),
        help="Run directory (metrics, weights, config.json).",
    )
    g.add_argument(
        "--num-steps",
        type=int,
        default=None,
        help="Train steps to run (default: --num-rollout x --num-steps-per-rollout).",
    )
    g.add_argument(
        "--num-rollout",
        type=int,
        default=None,
        help=f"slime-style: rollouts to run (default: {DEFAULT_NUM_ROLLOUT}).",
    )
    g.add_argument(
        "--save-interval",
        type=int,
        default=run_default("save_interval"),
        help="Checkpoint every N rollouts, slime's unit (N x --num-steps-per-rollout train "
        "steps; 0: only at the end, when --save is given).",
    )
    g.add_argument(
        "--update-weights-interval",
        type=int,
        default=run_default("update_weights_interval"),
        help="Push weights to the engines every N train steps.",
    )
    g.add_argument(
        "--warmstart-steps",
        type=int,
        default=None,
        help="Supervised warm-start steps on the built-in tasks, cached in the run "
        f"dir (default: {run_default('warmstart_steps')} for the embedded default run; "
        "0 with --hf-checkpoint, --prompt-data or --load, where it cannot apply).",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join (e.g. 10.0.0.1:6379; default: $RAY_ADDRESS, else a local "
        "node). Joined, engines and the router listen on their nodes' IPs and need the shared "
        "token. See docs/cluster.md.",
    )
    g.add_argument(
        "--auth-token-file",
        default=None,
        help=f"File holding the shared token of engines and router (default: ${AUTH_TOKEN_ENV}"
        "); never pass the token itself on the command line.",
    )
    g.add_argument("--use-wandb", action="store_true", help="Log to Weights & Biases.")
    g.add_argument("--use-tensorboard", action="store_true", help="Log to TensorBoard.")


def add_placement_args(parser: argparse.ArgumentParser) -> None:
    """Which CPU cores the trainer and the engines run on."""
    g = parser.add_argument_group("placement")
    g.add_argument(
        "--colocate",
        action="store_true",
        default=None,
        help="Share all CPU cores between trainer and engines, no pinning (default: on "
        "only when this process may use a single core). Not slime's GPU colocation: refused "
        "with --engine-backend sglang.",
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
