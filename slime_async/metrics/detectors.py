"""The divergence guards' detectors: pure functions on float sequences.

Owns `entropy_spike`, `logprob_diff_drift`, `is_weight_out_of_range`, `trend_drop`,
`window_mean_below` (each returns
(value, threshold) when its signal crossed, else None) and `finite`. Non-finite values (NaN,
inf, missing) are ignored: a detector fires on evidence, never on absence of data. Their
composition over a run's history, and the thresholds, are `guards.py`'s. Imports nothing from
slime_async.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def finite(values: Sequence[Any]) -> list[float]:
    """The finite numbers of `values`, as floats (bools, None, NaN and inf dropped)."""
    out = []
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def entropy_spike(
    values: Sequence[Any], *, window: int, factor: float, min_delta: float
) -> tuple[float, float] | None:
    """(current, threshold) if the last value spikes above the trailing median, else None."""
    if not values:
        return None
    cur = values[-1]
    prev = finite(values[:-1])[-window:]
    if not finite([cur]) or len(prev) < min(window, 3):
        return None
    ref = statistics.median(prev)
    threshold = max(ref * factor, ref + min_delta)
    return (float(cur), threshold) if cur > threshold else None


def logprob_diff_drift(
    baseline: Sequence[Any], recent: Sequence[Any], *, factor: float, min_abs: float
) -> tuple[float, float] | None:
    """(recent mean, threshold) if the mismatch drifted above its early baseline, else None.

    ``baseline`` holds the run's first values, ``recent`` the last few (no overlap).
    """
    base, xs = finite(baseline), finite(recent)
    if not base or len(xs) < max(1, len(recent) // 2):
        return None
    ref = statistics.median(base)
    mean = sum(xs) / len(xs)
    threshold = max(ref * factor, min_abs)
    return (mean, threshold) if mean > threshold else None


def is_weight_out_of_range(mean: Any, *, lower: float, upper: float) -> tuple[float, float] | None:
    """(mean, violated bound) if an IS weight mean left [lower, upper], else None."""
    if not finite([mean]):
        return None
    if mean < lower:
        return float(mean), lower
    if mean > upper:
        return float(mean), upper
    return None


def trend_drop(
    values: Sequence[Any], *, window: int, min_drop: float
) -> tuple[float, float] | None:
    """(fitted fall over the window, min_drop) if the least-squares line falls that much."""
    xs = finite(values)[-window:]
    if len(xs) < window:
        return None
    n = len(xs)
    mx = (n - 1) / 2
    my = sum(xs) / n
    slope = sum((i - mx) * (y - my) for i, y in enumerate(xs)) / sum(
        (i - mx) ** 2 for i in range(n)
    )
    drop = -slope * (n - 1)
    return (drop, min_drop) if drop > min_drop else None


def window_mean_below(
    values: Sequence[Any], *, window: int, floor: float
) -> tuple[float, float] | None:
    """(mean, floor) if the mean of the last `window` finite values is below `floor`, else
    None (also with fewer than `window` finite values)."""
    xs = finite(values)[-window:]
    if len(xs) < window:
        return None
    mean = sum(xs) / len(xs)
    return (mean, floor) if mean < floor else None
