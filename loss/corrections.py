"""Per-source correction functions f(r; l, u): cap, clip, icepop, none (spec §1).

Owns: `correct` (on ratio tensors; exact at the bounds, the public reference) and `correct_log`
(the same function on clamped log-ratios, used by the fused CompIS path: one exp for the product
of both sources' weights). Weights are always detached. Must never import `slime_async`.

Worked example (spec F2/F4): r = [1, 3, 0.25, 1.5]
    correct(r, "clip", 0.5, 2.0).weight   -> [1, 2, 0.5, 1.5]    clipped [0, 1, 1, 0]
    correct(r, "icepop", 0.5, 2.0).weight -> [1, 0, 0,   1.5]    masked  [0, 1, 1, 0]
"""

from __future__ import annotations

import math

import torch

from loss.types import Correction, Method, check_bounds, parse_enum


def _method(method: Method | str, low: float, high: float) -> Method:
    m = parse_enum(Method, method, field="method")
    check_bounds(m, low, high, field="correction")
    return m


def correct(
    ratio: torch.Tensor, method: Method | str, low: float = 0.0, high: float = 2.0
) -> Correction:
    """Apply f(r; l, u) to a ratio tensor r ≥ 0 (any shape).

    none: w = r. cap: w = 0 where r > u (r == u kept; low unused). clip: w = min(max(r, l), u),
    `clipped` = w ≠ r. icepop: w = r where l ≤ r ≤ u (inclusive), else 0.
    Returns `Correction(weight, masked, clipped)`, all detached, same shape as `ratio`.
    """
    m = _method(method, low, high)
    r = ratio.detach()
    no = torch.zeros_like(r, dtype=torch.bool)
    if m is Method.NONE:
        return Correction(r.clone(), no, no)
    if m is Method.CAP:
        masked = r > high
        return Correction(r.masked_fill(masked, 0.0), masked, no)
    if m is Method.CLIP:
        w = r.clamp(low, high)
        return Correction(w, no, w != r)
    masked = (r < low) | (r > high)
    return Correction(r.masked_fill(masked, 0.0), masked, no)


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def correct_log(
    log_ratio: torch.Tensor,
    method: Method,
    low: float,
    high: float,
    *,
    flags: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`correct` in log space: returns (log w, masked, clipped) with log w = −inf where masked.

    `log_ratio` must be detached, finite and clamped (see `safe_log_ratio`); it is not modified.
    With `flags=False` the bool tensors are skipped (None) unless needed to build w.
    The bounds compare against log(l), log(u): exact for ratios formed in log space.
    """
    d = log_ratio
    if method is Method.NONE:
        return d, None, None
    lo, hi = _log(low), _log(high)
    if method is Method.CLIP:
        w = d.clamp(lo, hi)
        clipped = ((d < lo) | (d > hi)) if flags else None
        return w, None, clipped
    masked = d > hi if method is Method.CAP else (d < lo) | (d > hi)
    return d.masked_fill(masked, -math.inf), masked, None
