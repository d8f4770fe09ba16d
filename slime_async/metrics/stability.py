"""Stability lab rules: what a finished run's curves say, as pure functions on float sequences.

Owns: `mean_and_se` (a mean and its standard error; the held-out eval logs it), `mean_ci` (a
t-interval over seeds), `VerdictRules` (the thresholds, stated once), `RunSummary` /
`summarize` (start, peak and end windows of one run's curves), `verdict` (stable / drifting /
collapsed for one run), `cell_verdict` (one verdict for the seeds of a grid cell) and
`guard_hits` (which divergence guards fired over a run). `scripts/bench_stability.py` runs the
grid and renders what these functions say; docs/stability.md states the rules in prose.
Imports nothing from slime_async except the guards.

The rules, in order (the first that holds wins):

* **collapsed**: a non-finite loss or gradient norm, or the train reward fell from its peak
  window by at least `collapse_reward_fall`, or the log-prob gap ended at least
  `collapse_gap_ratio` x its start;
* **drifting**: the train reward fell from its peak window by at least `drift_reward_fall`, or
  the log-prob gap ended at least `drift_gap_ratio` x its start (the issue's "visibly drifts");
* **stable**: otherwise. A stable run is also *flat* when the gap ratio is at most
  `flat_gap_ratio` (the issue's bar for CompIS).

"Start" is the first window after the first `skip_frac` of the logged steps (for the gap: also
after the run's staleness bound `S + ceil((W - 1) / B)` in steps, while which the staleness
budget fills and the gap rises because staler samples arrive, not because of drift), "end" the
last window, "peak" the best of the non-overlapping windows; every window is `window_frac` of
the steps (at least `min_window` of them).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from clifields import StrEnum
from slime_async.metrics.guards import GuardConfig, GuardKind, scan

GAP_KEY = "mismatch/train_rollout_logprob_abs_diff"
"""Train–rollout log-prob gap: mean |log π_k − log π_SGL| over the trained tokens."""
REWARD_KEY = "rollout/reward"
"""Train reward (mean over the step's samples)."""
NONFINITE_KEYS = ("loss/total", "train/grad_norm")
"""A non-finite value in any of these means the run blew up."""

# two-sided 97.5% Student-t quantiles for 1..30 degrees of freedom (a fixed table, not a fit)
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


class Verdict(StrEnum):
    """How a run behaved, from best to worst."""

    STABLE = "stable"
    DRIFTING = "drifting"
    COLLAPSED = "collapsed"


_ORDER = {Verdict.STABLE: 0, Verdict.DRIFTING: 1, Verdict.COLLAPSED: 2}


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of `values`; SE is 0 for fewer than two values.

    For the held-out eval (a fixed prompt set, several samples per prompt) this treats every
    sample as independent, which over-states the sampling error of the fixed set (the
    within-prompt variance is at most the total variance), so it is a safe upper bound.
    """
    xs = [float(v) for v in values]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(statistics.variance(xs, m) / len(xs))


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% Student-t interval) over `values` (e.g. one per seed);
    the half-width is NaN with fewer than two finite values."""
    xs = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan
    t = _T975[min(len(xs) - 1, len(_T975)) - 1]
    return m, t * statistics.stdev(xs) / math.sqrt(len(xs))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VerdictRules:
    """Thresholds of the verdict (module docstring: the rules in order)."""

    window_frac: float = 0.2
    """Each window (start, end, the peak's candidates) is this fraction of the logged steps."""
    min_window: int = 3
    """... and at least this many steps."""
    skip_frac: float = 0.1
    """The start window begins after this fraction of the steps (the staleness budget fills)."""
    drift_gap_ratio: float = 2.0
    """Gap end/start at or above this is drifting (the issue's "≥ 2× its start")."""
    collapse_gap_ratio: float = 5.0
    """Gap end/start at or above this is collapsed."""
    flat_gap_ratio: float = 1.2
    """Gap end/start at or below this is flat (the issue's bar for CompIS)."""
    drift_reward_fall: float = 0.1
    """Train reward end window this far below the peak window is drifting (about 3 standard
    errors of a 20%-window mean on the default 64-sample steps)."""
    collapse_reward_fall: float = 0.25
    """... and this far below is collapsed."""

    def __post_init__(self) -> None:
        if not (0 < self.window_frac <= 0.5 and 0 <= self.skip_frac < 1 - self.window_frac):
            raise ValueError(
                f"need 0 < window_frac <= 0.5 and 0 <= skip_frac < 1 - window_frac, got "
                f"{self.window_frac}, {self.skip_frac}"
            )
        if self.min_window < 1:
            raise ValueError(f"min_window must be >= 1, got {self.min_window}")
        if not 1 <= self.flat_gap_ratio <= self.drift_gap_ratio <= self.collapse_gap_ratio:
            raise ValueError("need 1 <= flat_gap_ratio <= drift_gap_ratio <= collapse_gap_ratio")
        if not 0 < self.drift_reward_fall <= self.collapse_reward_fall:
            raise ValueError("need 0 < drift_reward_fall <= collapse_reward_fall")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary:
    """What the verdict reads from one run."""

    steps: int
    """Logged train steps."""
    nonfinite: bool
    """A loss or gradient norm was NaN/inf."""
    gap_start: float
    """Mean log-prob gap over the start window."""
    gap_end: float
    """Mean log-prob gap over the end window."""
    reward_start: float
    """Mean train reward over the start window."""
    reward_peak: float
    """Best mean train reward over the non-overlapping windows."""
    reward_end: float
    """Mean train reward over the end window."""

    @property
    def gap_ratio(self) -> float:
        """gap_end / gap_start (NaN when either is missing or the start is 0)."""
        if not (self.gap_start > 0 and math.isfinite(self.gap_end)):
            return math.nan
        return self.gap_end / self.gap_start

    @property
    def reward_fall(self) -> float:
        """reward_peak − reward_end (≥ 0 when both exist)."""
        return self.reward_peak - self.reward_end


def _finite(values: Sequence[Any]) -> list[float]:
    return [
        float(v)
        for v in values
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def windows(
    values: Sequence[Any], rules: VerdictRules, *, fill_steps: int = 0
) -> tuple[float, float, float]:
    """(start, peak, end) window means of a series (NaN-free values only; NaN if too short);
    the start and peak windows begin after `skip_frac` of the values and after `fill_steps`."""
    xs = _finite(values)
    n = len(xs)
    w = max(rules.min_window, round(n * rules.window_frac))
    if n < w:
        return math.nan, math.nan, math.nan
    skip = min(max(int(n * rules.skip_frac), fill_steps), n - w)
    start = _mean(xs[skip : skip + w])
    end = _mean(xs[n - w :])
    chunks = [xs[i : i + w] for i in range(skip, n - w + 1, w)] + [xs[n - w :]]
    peak = max(_mean(c) for c in chunks)
    return start, peak, end


def summarize(
    records: Sequence[Mapping[str, Any]], rules: VerdictRules, *, fill_steps: int = 0
) -> RunSummary:
    """The window statistics of one run's merged per-step records (ordered by step).

    `fill_steps`: the run's staleness bound (`guards.staleness_fill_steps`). The gap's start
    window begins after it: until the staleness budget has filled, the gap rises because
    staler samples arrive, which is not drift."""
    train = [r for r in records if REWARD_KEY in r or GAP_KEY in r]
    nonfinite = any(
        isinstance(r.get(k), float) and not math.isfinite(r[k])
        for r in records
        for k in NONFINITE_KEYS
    )
    g_start, _, g_end = windows([r.get(GAP_KEY) for r in train], rules, fill_steps=fill_steps)
    r_start, r_peak, r_end = windows([r.get(REWARD_KEY) for r in train], rules)
    return RunSummary(
        steps=len(train),
        nonfinite=nonfinite,
        gap_start=g_start,
        gap_end=g_end,
        reward_start=r_start,
        reward_peak=r_peak,
        reward_end=r_end,
    )


def verdict(s: RunSummary, rules: VerdictRules) -> tuple[Verdict, str]:
    """(verdict, the rule that decided it) for one run."""
    ratio, fall = s.gap_ratio, s.reward_fall
    if s.nonfinite:
        return Verdict.COLLAPSED, "non-finite loss or gradient norm"
    if fall >= rules.collapse_reward_fall:
        return Verdict.COLLAPSED, f"train reward fell {fall:.2f} from its peak"
    if ratio >= rules.collapse_gap_ratio:
        return Verdict.COLLAPSED, f"log-prob gap end/start {ratio:.2f}"
    if fall >= rules.drift_reward_fall:
        return Verdict.DRIFTING, f"train reward fell {fall:.2f} from its peak"
    if ratio >= rules.drift_gap_ratio:
        return Verdict.DRIFTING, f"log-prob gap end/start {ratio:.2f}"
    if math.isnan(ratio) and math.isnan(fall):
        return Verdict.STABLE, "too few steps to judge"
    if math.isnan(ratio):  # e.g. a loss that logs no train/rollout mismatch
        return Verdict.STABLE, f"no log-prob gap logged, reward fall {fall:.2f}"
    flat = "flat" if ratio <= rules.flat_gap_ratio else "not flat"
    return Verdict.STABLE, f"gap end/start {ratio:.2f} ({flat}), reward fall {fall:.2f}"


def cell_verdict(verdicts: Sequence[Verdict]) -> tuple[Verdict, str]:
    """One verdict for a cell's seeds: the median (ties go to the worse), with the counts."""
    if not verdicts:
        raise ValueError("a cell needs at least one run to get a verdict")
    ranked = sorted(verdicts, key=_ORDER.__getitem__)
    mid = ranked[len(ranked) // 2]
    counts = ", ".join(
        f"{sum(v == k for v in verdicts)} {k}" for k in Verdict if any(v == k for v in verdicts)
    )
    return mid, counts


def guard_hits(records: Sequence[Mapping[str, Any]], cfg: GuardConfig | None = None) -> set[str]:
    """Names of the guards (`GuardKind` values) that fired at any step of the run."""
    return {str(w.kind) for w in scan(records, cfg or GuardConfig())}


__all__ = [
    "GAP_KEY",
    "REWARD_KEY",
    "GuardKind",
    "RunSummary",
    "Verdict",
    "VerdictRules",
    "cell_verdict",
    "guard_hits",
    "mean_and_se",
    "mean_ci",
    "summarize",
    "verdict",
    "windows",
]
