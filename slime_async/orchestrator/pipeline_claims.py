"""Sustained demand: the pipeline scheduler's claims, pure (no Ray, no clock, no I/O).

Owns what a pipeline's *claim* is made of and what it protects: `smooth_need` (its slot need
averaged over `demand_window_s`), `sustained_slots` (that average in whole slots, with
hysteresis), `sustain` (one report's update of both), `claim_caps` (the sustained needs the fair
shares are taken of: the claims are `fair_targets` of these, computed by the grant rules in
`pipeline_policy.py`), `kept` (the slots a holder never gives up: its claim, or its target),
`below_claim` (short of its claim: the only pipelines, priority aside, a busy slot is taken
for). The grant rules themselves (targets, free slots, lending, give-ups) stay in
`pipeline_policy.py`, which imports this module and never the other way round.
Rules: docs/pipeline-scheduler.md ("Sustained demand: claims").
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def smooth_need(avg: float | None, need: float, dt: float, window_s: float) -> float:
    """The exponential average of a pipeline's slot need over about `window_s` seconds, moved
    by a report of `need` `dt` seconds after the last one; the first report (`avg` None) is
    taken whole (a pipeline that joins claims what it needs at once).

    >>> smooth_need(None, 8, 0.0, 600.0)
    8.0
    >>> round(smooth_need(8.0, 0, 600.0, 600.0), 3)  # a window of zero need: down to 1/e
    2.943
    """
    if avg is None:
        return float(need)
    return avg + (need - avg) * -math.expm1(-dt / window_s)


def sustained_slots(avg: float, current: int) -> int:
    """`avg` in whole slots with half a slot of hysteresis: `current` stays until the average
    is a whole slot away from it (so an average rippling with each step's phase moves no
    slot), or below half a slot (demand gone: nothing is kept).

    >>> sustained_slots(3.9, 3), sustained_slots(4.1, 3), sustained_slots(1.9, 3)
    (3, 4, 2)
    >>> sustained_slots(0.4, 1)
    0
    """
    if avg < 0.5:
        return 0
    return current if abs(avg - current) < 1.0 else round(avg)


def sustain(
    avg: float | None, current: int, need: int, dt: float, window_s: float
) -> tuple[float, int]:
    """One report's update: the new average (`smooth_need`) and sustained slots
    (`sustained_slots`) of a pipeline that now needs `need` slots, `dt` after its last report.

    >>> sustain(None, 0, 3, 0.0, 600.0)
    (3.0, 3)
    """
    new = smooth_need(avg, need, dt, window_s)
    return new, sustained_slots(new, current)


def claim_caps(sustained: Mapping[str, int], engines: Mapping[str, int]) -> dict[str, int]:
    """What each pipeline's claim is a fair share of: its sustained slots, at most the slots it
    has engines on (`engines`); a pipeline with no sustained need yet claims nothing.

    >>> claim_caps({"a": 5}, {"a": 4, "b": 4})
    {'a': 4, 'b': 0}
    """
    return {n: min(k, sustained.get(n, 0)) for n, k in engines.items()}


def kept(target: int, claim: Mapping[str, int] | None, name: str) -> int:
    """The slots `name` keeps, idle or not: its target, or its claim when that is more (no
    claims: its target alone)."""
    return target if claim is None else max(target, claim[name])


def below_claim(holds: int, claim: Mapping[str, int], name: str) -> bool:
    """`name`, holding (or being granted) `holds` slots, is short of its claim."""
    return holds < claim[name]
