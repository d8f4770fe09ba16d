"""Staleness budget arithmetic (pure functions).

Owns the admission rule (and when a trainer's batch is out of its reach), the worst-case
staleness bound derived in docs/staleness-budget.md and the one place every consumer of that
bound reads it (`staleness_bound`: the derived drop, the snapshot count, the guards): a group is
admitted only while `live < (S + v + 1) * B`, which bounds the staleness of every consumed group
by `S + ceil((W - 1) / B)`, whatever the weight-push interval. Never imports `slime_async`.

Example:
    >>> admission_limit(max_staleness=2, served_version=3, groups_per_step=4)
    24
    >>> worst_case_staleness(max_staleness=2, fifo_window=5, groups_per_step=4)
    3
    >>> staleness_bound(max_staleness=2, fifo_window=5, groups_per_step=4, max_off_policy_steps=2)
    2
    >>> snapshot_count(bound=4, versions_every=1), snapshot_count(bound=4, versions_every=3)
    (5, 3)
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


def staleness_bound(
    *,
    max_staleness: int,
    fifo_window: float,
    groups_per_step: int,
    max_off_policy_steps: int | None = None,
) -> float:
    """Largest `k - j_min` of any trained token, `k` the trainer version that trains it:
    `min(S + ceil((W - 1) / B), N)` (N = `max_off_policy_steps`, None: no cap); inf when the
    window is unbounded and nothing caps it. The one source of the bound for the derived
    `--max-off-policy-steps` (N unset: the bound itself), the `--max-snapshots` count
    (`snapshot_count`) and the guards' staleness-fill estimate.

    The push interval `I` (`--update-weights-interval`) adds nothing. Between pushes the engines
    serve `v = p <= k` with `k - v <= I - 1`, but the budget counts against that served `v`, not
    against `k`: a group admitted at `live = a` under `v` has `a < (S + v + 1) * B` and every
    token of it is sampled on `>= v` (versions only rise), so `j_min >= floor(a / B) - S`; and
    the step that trains it has consumed at most `a + W - 1` groups before it, so
    `k <= floor((a + W - 1) / B)`. Neither step reads `k - v`: `k - j_min <= S + ceil((W - 1) /
    B)` for every `I` (docs/staleness-budget.md, "Worst-case staleness"). A lagging `v` only
    lowers how far generation runs ahead (and `S >= I - 1` keeps the last step before a push
    reachable). Only weights older than the pushed ones (a replacement engine on its start
    weights) can exceed the bound; the drop at `N` = this bound removes those groups.
    """
    bound = worst_case_staleness(
        max_staleness=max_staleness, fifo_window=fifo_window, groups_per_step=groups_per_step
    )
    if max_off_policy_steps is not None:
        bound = min(bound, max_off_policy_steps)
    return bound


def snapshot_count(*, bound: float, versions_every: int) -> float:
    """Weight snapshots (kept newest first, the oldest evicted by count) that hold pi_j^Meg of
    every version a trained token can carry, from `staleness_bound`'s `bound` `b`; inf for an
    unbounded `b`.

    A token trained at `k` carries a version `j` in `[k - b, k]`. The store must hold every
    such `j` that it snapshotted:

    * `versions_every = 1`: a snapshot of every version (the trainer, after each update; or
      pushes every step): `b + 1`.
    * `versions_every = I > 1`: snapshots only of the versions pushed to the engines (the
      forward-only role gets each pushed version before the engines do; nothing else is ever
      sampled). Pushes fall on multiples of `I`: a window of `b + 1` consecutive versions holds
      at most `floor(b / I) + 1` of them, plus one off that grid (the start version of a resumed
      run, or a push made early because every engine was a replacement): `floor(b / I) + 2`,
      never more than `b + 1` (distinct versions in `b + 1` consecutive ones). A second
      off-grid push within one bound could evict a needed version; the loss then falls back
      to the combined ratio for that step and says so (`loss/compis_fallback`), never a wrong
      value.
    """
    if math.isinf(bound):
        return math.inf
    b = int(bound)
    if versions_every <= 1:
        return b + 1
    return min(b + 1, b // versions_every + 2)
