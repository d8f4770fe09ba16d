"""CompIS in verl's policy-loss registry: `actor_rollout_ref.actor.policy_loss.loss_mode=compis`.

Owns: `compis_verl_loss` (verl's `PolicyLossFn` signature) and `register_with_verl`, which this
module runs on import. verl finds the module through its plugin entry point (`verl.plugins`
group, declared in pyproject.toml: loaded whenever verl is imported, if slime-async is installed)
or `VERL_USE_EXTERNAL_MODULES=loss.verl_adapter`. Imports verl (needed) and never `slime_async`.

What verl hands a policy loss, per micro-batch (`verl/workers/utils/losses.py::ppo_loss`):
`old_log_prob` (π_k, recomputed by the actor), `log_prob` (π_θ), `advantages`, `response_mask`
(`[B, T]`), `loss_agg_mode`, the actor `config` (clip ratios, `clip_ratio_c`,
`global_batch_info`) and `rollout_is_weights`: verl's own correction of π_k/π_rollout
(`algorithm.rollout_correction`), or None. Rollout log-probs themselves never reach the loss,
and verl keeps no π_j^Meg snapshots. So in verl CompIS runs in its combined-ratio form: r1 is
PPO-clipped (ε from `clip_ratio_low/high`, dual clip c from `clip_ratio_c`, as verl's vanilla
loss), and the behaviour weight f3(π_k/π_rollout) is verl's `rollout_is_weights`. Configure
verl's correction with CompIS's f3: `algorithm.rollout_correction.rollout_is=token` and
`rollout_is_threshold=5.0` (CompIS's default staleness `clip(0, 5)`), or `"0.0_5.0"` for
AReaL's cap. The loss is aggregated by verl's own `agg_loss` (every `loss_agg_mode`, global batch
info and DP scaling as verl defines them), so it equals verl's `vanilla` loss with the same
weights (tested); the engine/staleness split needs π_j^Meg and exists only in our trainer.
Our GSPO agrees with verl's `gspo` (tested), so it is not registered again. The baselines that
read rollout log-probs (m2po, prime_masked_is, sequence-level single_ratio) cannot run inside
verl's loss API; verl's `rollout_correction` presets cover TIS, IcePop, sequence IS and Geo-RS.
"""

from __future__ import annotations

from typing import Any

import torch

from loss.ppo import ppo_core

VERL_LOSSES = ("compis",)
"""Names this module registers in verl's `POLICY_LOSS_REGISTRY`."""


def _clip_bounds(config: Any) -> tuple[float, float, float]:
    clip = config.get("clip_ratio", 0.2)
    low = config.get("clip_ratio_low", None)
    high = config.get("clip_ratio_high", None)
    return (
        clip if low is None else low,
        clip if high is None else high,
        float(config.get("clip_ratio_c", 3.0)),
    )


def compis_verl_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """CompIS (combined-ratio form) under verl's policy-loss contract; shapes `[B, T]`.

    Per token: L = w·max(−A·r1, −A·clip(r1, 1 − ε_low, 1 + ε_high)), dual-clipped at −c·A for
    A < 0, with r1 = π_θ/π_k and w = `rollout_is_weights` (1 when verl computes none);
    aggregated by verl's `agg_loss`. Metrics: verl's `actor/pg_clipfrac`, `actor/ppo_kl`,
    `actor/pg_clipfrac_lower`, plus `actor/compis_weight_mean` and
    `actor/compis_weight_masked_frac` (tokens whose weight verl set to 0)."""
    from verl.trainer.ppo.core_algos import agg_loss

    if config is None:
        raise ValueError("compis needs verl's actor config (clip ratios, global_batch_info).")
    eps_low, eps_high, dual_c = _clip_bounds(config)
    mask = response_mask.bool()
    weight = (
        torch.ones_like(advantages, dtype=torch.float32)
        if rollout_is_weights is None
        else rollout_is_weights.detach()
    )
    adv = advantages.detach() * weight.to(advantages.dtype)  # w ≥ 0 commutes with max/min
    terms = ppo_core(log_prob, old_log_prob, adv, eps_low, eps_high, dual_c, mask=mask)
    loss = agg_loss(
        loss_mat=terms.loss,
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        **getattr(config, "global_batch_info", {}),
    )
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        assert terms.clipped is not None and terms.dual_clipped is not None
        metrics = {
            "actor/pg_clipfrac": float((terms.clipped & mask).sum() / n),
            "actor/ppo_kl": float(torch.where(mask, old_log_prob - log_prob, 0.0).sum() / n),
            "actor/pg_clipfrac_lower": float((terms.dual_clipped & mask).sum() / n),
            "actor/compis_weight_mean": float(torch.where(mask, weight, 0.0).sum() / n),
            "actor/compis_weight_masked_frac": float((mask & (weight == 0)).sum() / n),
        }
    return loss, metrics


def register_with_verl() -> list[str]:
    """Register `VERL_LOSSES` in verl's policy-loss registry (idempotent); returns the names.
    A name verl already uses for a different function is refused, never overwritten."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    fns = {"compis": compis_verl_loss}
    for name, fn in fns.items():
        have = POLICY_LOSS_REGISTRY.get(name)
        if have is not None and have is not fn:
            raise ValueError(
                f"verl already has a policy loss named {name!r} ({have.__module__}."
                f"{have.__qualname__}); slime-async will not replace it."
            )
        register_policy_loss(name)(fn)
    return list(fns)


register_with_verl()
