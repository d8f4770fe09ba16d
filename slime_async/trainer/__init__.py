"""Megatron-core trainer: model build, log-prob forwards, CompIS train step, routing replay,
HF weight export/import, guarded checkpoints, and a thin Ray actor wrapper (`actor.py`).
What it takes and gives (`TrainerBatch`, `HFWeights`, `ModelSpec`) lives in `slime_async.contracts`.

Heavy imports (torch, megatron, ray) happen when the submodules are imported, not here.
Must never import the controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "MegatronTrainer",
    "RoutingReplay",
    "TrainerConfig",
]


def __getattr__(name: str) -> object:
    if name == "MegatronTrainer":
        from slime_async.trainer.trainer import MegatronTrainer

        return MegatronTrainer
    if name == "TrainerConfig":
        from slime_async.trainer.config import TrainerConfig

        return TrainerConfig
    if name == "RoutingReplay":
        from slime_async.trainer.replay import RoutingReplay

        return RoutingReplay
    if name == "CheckpointError":
        from slime_async.trainer.checkpoint import CheckpointError

        return CheckpointError
    raise AttributeError(name)
