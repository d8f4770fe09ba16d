"""The stability lab's goals: the bars its report checks the grid against, in one place.

Owns `Goals` and `GOALS`, the values `lab.report.goal_checks` tests and prints. Imports
nothing from the project; `slime_async` must never import it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Goals:
    """What the lab expects at the largest staleness that ran, and of routing replay."""

    drift_gap_ratio: float = 2.0
    """Uncorrected PPO drifts: its train–rollout gap grows at least this much (end window over
    start window), or its verdict is not stable."""

    flat_gap_ratio: float = 1.2
    """CompIS holds: its gap end/start stays at or below this."""

    eval_vs_sync: float = 0.05
    """CompIS keeps up: its final eval reward is within this of the synchronous run's (the
    seed-paired difference against staleness 0, same routing replay and steps per rollout)."""

    replay_change: float = -0.38
    """Routing replay (R3) changes the gap by this or better (geometric mean ratio on/off − 1):
    −38% is Relax's figure."""


GOALS = Goals()
"""The goals the lab's report checks."""
