"""The launch-time resume step: where a started trainer puts the run, checked once.

Owns `StartPoint` and `start_point`: the trainer's version and checkpointed state, checked
against each other and against this run (step = version, the data worker's state is there, the
batch shape matches), and the prompt ledger made to match (truncated after the checkpoint on a
resume, an earlier run's moved aside on a fresh start). Checks that need no trainer (flags,
paths, the checkpoint's presence) are the config wing's, at parse time
(`slime_async.config`); this is the part that needs the trainer up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slime_async.config.run_config import RunConfig
from slime_async.config.run_paths import check_batch_shape
from slime_async.orchestrator.ledger import archive_stale_ledger, ledger_path, truncate_ledger


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StartPoint:
    """Where the run starts."""

    version: int
    """The trainer's version (the checkpoint's step on resume, else 0)."""
    worker_state: dict[str, Any] | None
    """The data worker's checkpointed state to restore (None: a fresh start)."""


def start_point(cfg: RunConfig, trainer: Any, *, load: str | None) -> StartPoint:
    """Read the trainer's version and extra state (blocking); with `load` (the trainer resumed
    from it) refuse an inconsistent checkpoint, one without the data worker's state or of
    another batch shape, and drop the ledger's rolled-back steps; without, start a new
    ledger."""
    extra = trainer.extra_state()
    version = trainer.version()
    ledger = ledger_path(cfg.run_dir)
    if not load:
        archive_stale_ledger(ledger)
        return StartPoint(version=version, worker_state=None)
    start_step = int(extra.get("step", 0))
    if start_step != version:
        raise RuntimeError(
            f"checkpoint in {load} says step {start_step} but the trainer is at "
            f"version {version}; the checkpoint is inconsistent, load an earlier one"
        )
    if "worker" not in extra:
        raise ValueError(
            f"checkpoint in {load} holds no data-worker state (it was not written "
            "by train_async.py), so a resume would lose or repeat prompts; start from its "
            "weights with --hf-checkpoint instead of --load"
        )
    check_batch_shape(extra.get("batch_shape"), cfg, where=str(load))
    truncate_ledger(ledger, keep_through=start_step)
    return StartPoint(version=version, worker_state=extra["worker"])
