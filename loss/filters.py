"""`--max-off-policy-steps N` group filter (docs/loss-spec.md §11).

Owns: `max_off_policy_filter`. A sample's staleness is k − j_min, with j_min the oldest version
that produced any of its trainable tokens; whole groups are evicted when any member exceeds N
(staleness of a group = that of its oldest member), so group statistics are never computed on a
partial group. Run it before advantages and loss denominators. Must never import `slime_async`.

Worked example (spec O1): k = 9, sample versions [5, 7, 8, 9], N = 2
    staleness [4, 2, 1, 0] → keep [False, True, True, True]
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class OffPolicyFilterResult:
    """Which samples survive, each sample's staleness, and what to log."""

    keep: list[bool]
    """Per sample: True if kept."""
    staleness: list[int]
    """Per sample: k − j_min."""
    metrics: dict[str, float]
    """`staleness/evicted`, `staleness/evicted_{mean,max,min}`, `staleness/kept_hist/<d>`, ..."""


def max_off_policy_filter(
    current_version: int,
    versions: Sequence[int | Sequence[int]],
    max_steps: int,
    *,
    group_ids: Sequence[int] | None = None,
) -> OffPolicyFilterResult:
    """Keep a sample iff (k − j_min) ≤ N, evicting whole groups when `group_ids` is given.

    `versions[i]` is the version of sample i, or the per-token versions of its trainable tokens
    (partial rollouts). N = 0 is strictly on-policy.
    """
    if max_steps < 0:
        raise ValueError(f"max_off_policy_steps={max_steps} must be >= 0 (0 = strictly on-policy).")
    stale = []
    for v in versions:
        j_min = min(v) if isinstance(v, Sequence) else int(v)
        if isinstance(v, Sequence) and len(v) == 0:
            raise ValueError(
                "a sample has no token versions; pass its version or drop it upstream."
            )
        if j_min > current_version:
            raise ValueError(
                f"sample version {j_min} is newer than the trainer version {current_version}."
            )
        stale.append(current_version - j_min)
    if group_ids is None:
        group_ids = list(range(len(stale)))
    if len(group_ids) != len(stale):
        raise ValueError(f"group_ids has {len(group_ids)} entries for {len(stale)} samples.")
    worst: dict[int, int] = {}
    for g, s in zip(group_ids, stale):
        worst[g] = max(worst.get(g, 0), s)
    keep = [worst[g] <= max_steps for g in group_ids]
    evicted = [s for s, k in zip(stale, keep) if not k]
    kept = [s for s, k in zip(stale, keep) if k]
    metrics: dict[str, float] = {
        "staleness/evicted": float(len(evicted)),
        "staleness/evicted_groups": float(sum(1 for g, w in worst.items() if w > max_steps)),
        "staleness/kept_mean": sum(kept) / len(kept) if kept else 0.0,
        "staleness/kept_max": float(max(kept)) if kept else 0.0,
    }
    if evicted:
        metrics["staleness/evicted_mean"] = sum(evicted) / len(evicted)
        metrics["staleness/evicted_max"] = float(max(evicted))
        metrics["staleness/evicted_min"] = float(min(evicted))
    for d, c in sorted(Counter(kept).items()):
        metrics[f"staleness/kept_hist/{d}"] = float(c)
    return OffPolicyFilterResult(keep=keep, staleness=stale, metrics=metrics)
