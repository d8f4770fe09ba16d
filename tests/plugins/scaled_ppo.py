"""A test-only loss added as a plugin: one file plus one registry line (the last line).

PPO on r1 times a factor that comes from the command line (`--loss scaled_ppo --loss-config
scale=3`). It declares that it reads π_k and π_j^SGL only, so the trainer runs no snapshot
forward for it; it reports the factor it received as `plugin/scale`.
"""

from __future__ import annotations

import dataclasses

from loss import LossInputs, LossNeeds, LossOutputs, PPOConfig, get_loss, register_loss


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScaledPPOConfig(PPOConfig):
    """PPO knobs plus the factor."""

    scale: float = 1.0
    """Factor the PPO loss is multiplied by."""

    def __post_init__(self) -> None:
        PPOConfig.__post_init__(self)
        if not self.scale > 0:
            raise ValueError(f"scale={self.scale} must be > 0")


def scaled_ppo(inputs: LossInputs, cfg: ScaledPPOConfig) -> LossOutputs:
    """`scale` × plain PPO (the built-in "ppo" loss)."""
    out = get_loss("ppo")(inputs, PPOConfig(**cfg.ppo_knobs()))
    return LossOutputs(
        loss=out.loss * cfg.scale, metrics={**out.metrics, "plugin/scale": cfg.scale}
    )


register_loss(
    "scaled_ppo", scaled_ppo, config_cls=ScaledPPOConfig, needs=LossNeeds(behavior_logprobs=False)
)
