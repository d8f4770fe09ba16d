"""Small pure helpers that turn per-sample values into loggable metrics.

Owns `count_hist` (the ``staleness/hist`` format the report reads: ``hist[i]`` = how many samples
had value ``i``). Imports nothing from slime_async.
"""

from __future__ import annotations

from collections.abc import Iterable


def count_hist(values: Iterable[int], *, max_bin: int | None = None) -> list[int]:
    """Counts of non-negative integers: ``out[i]`` = number of values equal to ``i``.

    Values above ``max_bin`` are counted in the last bin (``max_bin``). Example:
    ``count_hist([0, 2, 2, 5], max_bin=3) == [1, 0, 2, 1]``.
    """
    counts: dict[int, int] = {}
    for v in values:
        i = int(v)
        if i < 0:
            raise ValueError(f"count_hist takes non-negative integers, got {v}")
        if max_bin is not None:
            i = min(i, max_bin)
        counts[i] = counts.get(i, 0) + 1
    if not counts:
        return []
    return [counts.get(i, 0) for i in range(max(counts) + 1)]
