"""The KL penalty to a reference policy, per token (slime's `--kl-loss-type`, verl's `kl_loss_type`).

Owns: `KLType` and `kl_penalty`. Pure tensor math; must never import `slime_async`.

With Δ = log π_θ − log π_ref per token (clamped to ±20, non-finite → 0, as every log-ratio here;
Schulman's estimators of KL(π_θ ‖ π_ref) for tokens sampled from π_θ):

| kind | value | gradient |
|---|---|---|
| `k1` | Δ | unbiased KL value, its gradient is not KL's |
| `k2` | Δ²/2 | low variance; gradient = gradient of KL for small Δ |
| `k3` | exp(−Δ) − 1 + Δ | unbiased and ≥ 0 |
| `low_var_kl` | k3 clamped to [−10, 10] | slime's and verl's name for the clamped k3 |

Worked example: Δ = log 2 gives k1 = 0.693, k2 = 0.240, k3 = 0.5 − 1 + 0.693 = 0.193.
"""

from __future__ import annotations

import torch

from clifields import StrEnum
from loss.ratios import safe_log_ratio


class KLType(StrEnum):
    """Estimator of KL(π_θ ‖ π_ref) per token."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    LOW_VAR_KL = "low_var_kl"


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: KLType | str = KLType.LOW_VAR_KL,
    *,
    importance_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate (see the module table); gradient flows through `logprobs` (and
    `importance_ratio`) only. Shapes: any, equal. bf16/fp16 inputs are upcast to fp32 first.

    `importance_ratio` (slime's `--use-unbiased-kl`, DeepSeek-V3.2's unbiased KL): π_θ/π_old of
    each token, multiplied into the estimate before low_var_kl's clamp (slime's order), so the
    KL of tokens sampled from π_old is estimated for π_θ."""
    try:
        kind = KLType(kind)
    except ValueError:
        raise ValueError(
            f"unknown KL type {kind!r}; choose one of {[k.value for k in KLType]}."
        ) from None
    d = safe_log_ratio(logprobs, ref_logprobs.detach())
    if kind is KLType.K1:
        kl = d
    elif kind is KLType.K2:
        kl = 0.5 * d * d
    else:
        kl = torch.expm1(-d) + d
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(-10.0, 10.0) if kind is KLType.LOW_VAR_KL else kl
