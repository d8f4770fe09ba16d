"""Per-source correction functions f(r; l, u): cap, clip, icepop, none (docs/loss-spec.md §1).

Owns the rule, written once: `clip_bounds` (where `clip` truncates) and `mask_excess` (where
`cap`/`icepop` zero the weight), each in ratio space or, since log is monotone, in log space
against log(l), log(u). Built on them: `correct` (on ratio tensors; exact at the bounds, the
public reference), `correct_log` (the same on clamped log-ratios, for diagnostics) and the
fused CompIS path (`loss.compis`: float ops only, one exp for both sources' weights). Weights
are always detached. Must never import `slime_async`.

Worked example (spec F2/F4): r = [1, 3, 0.25, 1.5]
    correct(r, "clip", 0.5, 2.0).weight   -> [1, 2, 0.5, 1.5]    clipped [0, 1, 1, 0]
    correct(r, "icepop", 0.5, 2.0).weight -> [1, 0, 0,   1.5]    masked  [0, 1, 1, 0]
"""

from __future__ import annotations

import math

import torch

from loss.types import Correction, Method, check_bounds, parse_enum


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def clip_bounds(low: float, high: float, *, log_space: bool) -> tuple[float, float]:
    """(l, u), or (log l, log u) in log space (log 0 = −inf): the range `clip` truncates to
    and outside which `icepop` masks."""
    return (_log(low), _log(high)) if log_space else (low, high)


def mask_excess(
    x: torch.Tensor, method: Method, low: float, high: float, *, log_space: bool
) -> torch.Tensor | None:
    """How far each value lies past the bounds where `method` zeroes the weight: 0 where the
    token is kept, > 0 exactly where it is masked (cap: r > u; icepop: r < l or r > u; both
    bounds inclusive). None for `none`/`clip`, which never mask. A fresh tensor, float ops only.
    """
    if method not in (Method.CAP, Method.ICEPOP):
        return None
    lo, hi = clip_bounds(low, high, log_space=log_space)
    over = (x - hi).clamp_(min=0.0)
    if method is Method.ICEPOP and lo > -math.inf:  # log space with l = 0: nothing is below
        over.add_((lo - x).clamp_(min=0.0))
    return over


def _apply(
    x: torch.Tensor, method: Method, low: float, high: float, *, log_space: bool, flags: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(w, masked, clipped) on detached `x`; masked tokens get 0 (ratio) or −inf (log w)."""
    if method is Method.NONE:
        return x, None, None
    if method is Method.CLIP:
        lo, hi = clip_bounds(low, high, log_space=log_space)
        return x.clamp(lo, hi), None, ((x < lo) | (x > hi)) if flags else None
    excess = mask_excess(x, method, low, high, log_space=log_space)
    assert excess is not None
    masked = excess > 0
    return x.masked_fill(masked, -math.inf if log_space else 0.0), masked, None


def correct(
    ratio: torch.Tensor, method: Method | str, low: float = 0.0, high: float = 2.0
) -> Correction:
    """Apply f(r; l, u) to a ratio tensor r ≥ 0 (any shape).

    none: w = r. cap: w = 0 where r > u (r == u kept; low unused). clip: w = min(max(r, l), u),
    `clipped` = w ≠ r. icepop: w = r where l ≤ r ≤ u (inclusive), else 0.
    Returns `Correction(weight, masked, clipped)`, all detached, same shape as `ratio`.
    """
    m = parse_enum(Method, method, field="method")
    check_bounds(m, low, high, field="correction")
    r = ratio.detach()
    w, masked, clipped = _apply(r, m, low, high, log_space=False, flags=True)
    no = torch.zeros_like(r, dtype=torch.bool)
    w = r.clone() if w is r else w
    return Correction(w, no if masked is None else masked, no if clipped is None else clipped)


def correct_log(
    log_ratio: torch.Tensor,
    method: Method | str,
    low: float,
    high: float,
    *,
    flags: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`correct` in log space: returns (log w, masked, clipped) with log w = −inf where masked.

    `log_ratio` must be detached, finite and clamped (see `safe_log_ratio`); it is not modified.
    With `flags=False` the clip flags are skipped (None); `masked` is None for methods that
    never mask. The bounds compare against log(l), log(u): exact for ratios formed in log space.
    """
    m = parse_enum(Method, method, field="method")
    return _apply(log_ratio, m, low, high, log_space=True, flags=flags)
