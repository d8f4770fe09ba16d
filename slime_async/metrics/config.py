"""`LoggingConfig`: which external loggers a run writes to (wandb, TensorBoard), and their flags.

Owns `LoggingConfig` (slime's `--use-wandb`, `--wandb-*` and `--use-tensorboard` names, one
field each), `add_logging_args`, `logging_config_from_args`, and `refused_secret_flags` (slime
flags that would put a secret on the command line: `--wandb-key`). A flag left unset leaves
wandb's own `WANDB_*` environment variable in charge (wandb reads them itself). The API key is
never a flag: wandb reads `WANDB_API_KEY` from the environment, so it never lands in argv, the
logs or config.json. Imports only `clifields`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Literal

from clifields import add_flags, from_args

SECRET_FLAGS = {
    "--wandb-key": "export WANDB_API_KEY=<key> (or run `wandb login` once) instead; "
    "the key is never taken on the command line, where it would land in the process list, "
    "the shell history and the run's config.json",
}
"""slime flags that carry a secret: refused, with the environment variable to use instead."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    """Where the run's metrics go besides RUN_DIR/metrics.jsonl and the console."""

    use_wandb: bool = False
    """Also log to Weights & Biases: the run's config.json is the wandb run's config, and the
    wandb run id is kept in RUN_DIR/wandb_run_id, so a resume (--load) continues the same wandb
    run; a new run in the same run directory sets the old id aside and starts its own. The API
    key comes from $WANDB_API_KEY (or `wandb login`), never from a flag."""
    wandb_project: str | None = None
    """wandb project (default: $WANDB_PROJECT, else slime-async)."""
    wandb_team: str | None = None
    """wandb entity: team or user (default: $WANDB_ENTITY, else your default entity)."""
    wandb_group: str | None = None
    """wandb group of the run (default: $WANDB_RUN_GROUP, else none)."""
    wandb_run_id: str | None = None
    """wandb run id to log into (default: $WANDB_RUN_ID, else, resuming with --load, the one
    stored in RUN_DIR/wandb_run_id, else a new one); stored in RUN_DIR/wandb_run_id for the next
    resume."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """wandb mode (default: $WANDB_MODE, else online); offline runs upload later with
    `wandb sync`."""
    wandb_dir: str | None = None
    """Directory of wandb's local files (default: $WANDB_DIR, else the run directory)."""
    wandb_host: str | None = None
    """wandb server URL, for a self-hosted server (default: $WANDB_BASE_URL, else
    https://api.wandb.ai)."""
    use_tensorboard: bool = False
    """Also log to TensorBoard: scalars and histograms in RUN_DIR/tensorboard."""

    def __post_init__(self) -> None:
        if not self.use_wandb:
            given = [
                "--" + f.name.replace("_", "-")
                for f in dataclasses.fields(self)
                if f.name.startswith("wandb_") and getattr(self, f.name) is not None
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} would do nothing without --use-wandb: add --use-wandb "
                    "(or drop the wandb flags)"
                )


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """The `logging` flag group: one flag per `LoggingConfig` field."""
    add_flags(parser, LoggingConfig, group="logging")


def logging_config_from_args(args: argparse.Namespace) -> LoggingConfig:
    """`LoggingConfig` from the parsed flags."""
    return from_args(LoggingConfig, args)


def refused_secret_flags(argv: Sequence[str]) -> list[str]:
    """One sentence per secret-carrying slime flag in `argv` (its value is never repeated)."""
    errors = []
    for name, fix in SECRET_FLAGS.items():
        if any(a == name or a.startswith(name + "=") for a in argv):
            errors.append(f"{name} is not accepted: {fix}")
    return errors
