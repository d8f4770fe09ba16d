"""Staleness budget arithmetic (pure functions).

Owns the admission rule (and when a trainer's batch is out of its reach) and the worst-case
staleness bound derived in docs/staleness-budget.md:
a group is admitted only while `live < (S + v + 1) * B`, which bounds the staleness of every
consumed group by `S + ceil((W - 1) / B)`. Never imports `slime_async`.

Example:
    >>> admission_limit(max_staleness=2, served_version=3, groups_per_step=4)
    24
    >>> worst_case_staleness(max_staleness=2, fifo_window=5, groups_per_step=4)
    3
    >>> batch_reachable(current_version=6, served_version=3, max_staleness=2, groups_per_step=4)
    False
"""

from __future__ import annotations

import math


def admission_limit(*, max_staleness: int, served_version: int, groups_per_step: int) -> int:
    """Groups that may have been admitted (minus dropped/filtered) while engines serve v."""
    return (max_staleness + served_version + 1) * groups_per_step


def batch_reachable(
    *, current_version: int, served_version: int, max_staleness: int, groups_per_step: int
) -> bool:
    """Can the batch of train step k = `current_version` ever be admitted while engines serve v?

    Step k consumes groups [kB, (k+1)B); the budget admits groups below (S + v + 1)B, so the
    batch is reachable iff (k + 1)B <= (S + v + 1)B, i.e. k - v <= S. When it is not, the
    caller must push weights (raise v) before waiting for that batch.
    """
    limit = admission_limit(
        max_staleness=max_staleness, served_version=served_version, groups_per_step=groups_per_step
    )
    return (current_version + 1) * groups_per_step <= limit


def window_slack_steps(*, fifo_window: float, groups_per_step: int) -> float:
    """Extra staleness the FIFO window can add: ceil((W - 1) / B); inf for W = inf."""
    if math.isinf(fifo_window):
        return math.inf
    return -(-(int(fifo_window) - 1) // groups_per_step)


def worst_case_staleness(*, max_staleness: int, fifo_window: float, groups_per_step: int) -> float:
    """Largest k - j_min any consumed group can have: S + ceil((W - 1) / B)."""
    return max_staleness + window_slack_steps(
        fifo_window=fifo_window, groups_per_step=groups_per_step
    )
