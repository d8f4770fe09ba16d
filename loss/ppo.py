"""PPO surrogate on the drift ratio r1 = π_θ / π_k: clip, DAPO clip-higher, optional dual clip (docs/loss-spec.md §2).

Owns: `ppo_surrogate` and `ppo_core` (the same, also returning r1 and the dual-clip flags for
diagnostics). r1 is the only ratio that carries gradient. Must never import `slime_async`.

Worked example (spec P1): A = [1, 1, −1, −1], r1 = [1.5, 0.5, 1.5, 0.5], ε = 0.2
    per-token L = max(−A·r1, −A·clip(r1, 0.8, 1.2)) = [−1.2, −0.5, 1.5, 0.8], clipped [1, 0, 0, 1]
"""

from __future__ import annotations

import dataclasses

import torch

from loss.ratios import safe_log_ratio
from loss.types import upcast


@dataclasses.dataclass(frozen=True, slots=True)
class PPOTerms:
    """Per-token PPO results; all but `loss` are detached."""

    loss: torch.Tensor
    """Per-token surrogate loss (with grad through `logprobs`)."""
    ratio: torch.Tensor
    """r1 = exp(clamped log π_θ − log π_k), detached."""
    clipped: torch.Tensor | None
    """Bool: the clipped branch binds strictly (−A·clip(r1) > −A·r1); None if not requested."""
    dual_clipped: torch.Tensor | None
    """Bool: the dual clip binds (A < 0 and L > −c·A); None when dual clip is off."""


def _check(eps_low: float, eps_high: float, dual_clip_c: float | None) -> None:
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(
            f"PPO clip needs 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high} "
            f"(PPO default 0.2/0.2, DAPO 0.2/0.28)."
        )
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c={dual_clip_c} must be > 1 (e.g. 3.0) or None.")


def masked_neg_advantages(
    advantages: torch.Tensor, mask: torch.Tensor, *, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(−A with non-finite values and positions outside the bool `mask` set to 0, `mask` as
    0/1 floats). NaN-safe (the product comes after `nan_to_num`, never inf·0) and built from
    float passes only (no `where`, several times slower on CPU). Detached; shaped like `mask`."""
    with torch.no_grad():
        mask_f = mask.to(dtype)
        neg = upcast(advantages.detach()).to(dtype).nan_to_num(0.0, 0.0, 0.0).mul_(mask_f).neg_()
    return neg, mask_f


def ppo_from_neg_adv(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    neg_adv: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
    *,
    log_ratio_clamp: float = 20.0,
    with_clipped: bool = True,
) -> PPOTerms:
    """`ppo_core` on a precomputed, finite, detached −A (internal fast path)."""
    dtype = neg_adv.dtype
    d = safe_log_ratio(logprobs, proximal_logprobs.detach(), clamp=log_ratio_clamp, dtype=dtype)
    ratio = d.exp()
    surr = neg_adv * ratio
    surr_clip = neg_adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(surr, surr_clip)
    clipped = (surr_clip.detach() > surr.detach()) if with_clipped else None
    dual = None
    if dual_clip_c is not None:
        bound = neg_adv * dual_clip_c
        with torch.no_grad():
            dual = (neg_adv > 0) & (loss.detach() > bound)
        loss = torch.where(dual, bound, loss)
    return PPOTerms(loss=loss, ratio=ratio.detach(), clipped=clipped, dual_clipped=dual)


def ppo_core(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
    *,
    mask: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
) -> PPOTerms:
    """PPO clipped surrogate per token. Shapes: all `[B, T]` or all `[N]`.

    L = max(−A·r1, −A·clip(r1, 1 − eps_low, 1 + eps_high)); with `dual_clip_c` = c, tokens with
    A < 0 take min(L, −c·A). If `mask` (bool) is given, advantages outside it (and non-finite
    ones) count as 0, so L is exactly 0 there and no NaN can leak from padding: aggregate with
    `premasked=True`. Gradient: −A·r1·∂lp_θ on the unclipped branch, else 0.
    """
    _check(eps_low, eps_high, dual_clip_c)
    fp64 = torch.float64 in (logprobs.dtype, proximal_logprobs.dtype, advantages.dtype)
    dtype = torch.float64 if fp64 else torch.float32
    if mask is not None:
        neg_adv, _ = masked_neg_advantages(advantages, mask, dtype=dtype)
    else:
        neg_adv = upcast(advantages.detach()).to(dtype).neg()
    return ppo_from_neg_adv(
        logprobs,
        proximal_logprobs,
        neg_adv,
        eps_low,
        eps_high,
        dual_clip_c,
        log_ratio_clamp=log_ratio_clamp,
    )


def ppo_surrogate(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
    *,
    mask: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss and the strict clip indicator; see `ppo_core`.

    Returns `(per_token_loss, clipped)` shaped like `logprobs`.
    """
    t = ppo_core(
        logprobs,
        proximal_logprobs,
        advantages,
        eps_low,
        eps_high,
        dual_clip_c,
        mask=mask,
        log_ratio_clamp=log_ratio_clamp,
    )
    assert t.clipped is not None
    return t.loss, t.clipped
