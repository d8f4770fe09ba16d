"""What a run offers a weight transport to build itself from: `TransportSetup`, the argument of
every transport's `from_setup` classmethod (`slime_async.weights.registry`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from router.client import RouterClient
from slime_async.contracts.adapter import LoraSpec
from slime_async.weights.config import WeightSyncConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransportSetup:
    """What a run hands `from_setup`: each transport takes the parts it needs."""

    run_dir: Path
    """The run directory: directory transports write their versions under it."""
    trainer: Any
    """The trainer group: it writes versions (`save_weights`, `save_adapter`), is the sender of
    the full weights (`slime_async.weights.WeightSender`) and gives the adapter's
    (`adapter_sender()`)."""
    control: RouterClient
    """The router's control client (pause, loads fanned out to every engine)."""
    engine_urls: Callable[[], Sequence[str]]
    """The engines now (read at every push: the supervisor may have replaced some)."""
    cfg: WeightSyncConfig
    """`--update-weight-*`."""
    collective_backend: str = "gloo"
    """The engines' collective backend (gloo for CPU engines, NCCL for GPU ones)."""
    token: str | None = None
    """The run's admin key: the weight routes an engine takes are its admin routes."""
    on_written: Callable[[int, Path], object] | None = None
    """Called with (version, directory) after a directory transport wrote it (the forward-only
    role's feed); None: nobody listens."""
    lora: LoraSpec | None = None
    """The run's LoRA adapter (None: full-weight training)."""
