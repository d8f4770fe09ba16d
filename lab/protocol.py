"""The staleness sweep's pre-registered protocol as data, and its decision rules as pure functions.

Owns what docs/stability-protocol.md fixes before any run: the search regimes (`REGIMES`), the
arms (`ARMS`: protocol name -> lab loss name), the phases' cells and seeds (`search_cells`,
`confirm_cells`), the rule that picks the confirmatory regime from the search
(`choose_regime`), and the equivalence test (`tost`: two one-sided tests on seed-paired
differences, `MARGIN`); phase 3's workload (`WORKLOAD_S`), the rule that picks its staleness
from phase 2 (`phase3_staleness`) and its cells (`phase3_cells`). Running the phases is `scripts/bench_stability.py --protocol`; reading
runs back is `lab.analysis`. Pure: no files, no processes.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from lab.analysis import Cell

MARGIN = 0.05
"""Equivalence margin on the final held-out pass rate (the paired difference's 90% interval
must lie inside ±MARGIN)."""
UNLEARN = 0.05
"""A sync run whose final held-out pass rate is this far below its step-0 baseline unlearned:
its regime cannot test whether async matches sync (amendment 1)."""
BREAK_DROP = 0.05
"""The uncorrected arm breaks when its mean paired deficit to sync reaches this."""
ARMS: dict[str, str] = {"sync": "ppo", "none": "ppo", "tis": "tis", "is": "is", "compis": "compis"}
"""Protocol arm -> the lab's loss name (sync is `ppo` at staleness 0)."""
ASYNC_ARMS = ("none", "tis", "is", "compis")
STALENESS = (1, 4, 8)
PRIMARY_STALENESS = 8
SEARCH_SEEDS = (1, 2)
CONFIRM_PRIMARY_SEEDS = tuple(range(11, 21))
CONFIRM_OTHER_SEEDS = (11, 12, 13)
S_PRIMARY_SEEDS = (11, 12, 13, 14, 15)
"""Phase 3: seeds of sync, none and compis."""
S_OTHER_SEEDS = (11, 12, 13)
"""Phase 3: seeds of tis and is."""
DIFFER = 0.05
"""Workload T's async arms differ at a staleness when the means over seeds of their final
held-out pass rates span at least this (amendment 2)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Regime:
    """One setting of the search: a name (its output directory) and the extra train flags."""

    name: str
    flags: tuple[str, ...]


REGIMES = (
    Regime(name="lr1e-4", flags=("--lr", "1e-4")),
    Regime(name="lr4e-4", flags=("--lr", "4e-4")),
    Regime(name="lr8e-4", flags=("--lr", "8e-4")),  # amendment 1
    Regime(name="lr1.6e-3", flags=("--lr", "1.6e-3")),
)
"""The search's regimes in the order the rule reads them."""


def _cell(arm: str, staleness: int, seed: int, *, replay: bool = True) -> Cell:
    s = 0 if arm == "sync" else staleness
    return Cell(staleness=s, loss=ARMS[arm], replay=replay, nspr=1, seed=seed)


def search_cells() -> list[Cell]:
    """One regime's search runs: sync, none and compis at S = 8, seed by seed."""
    return [
        _cell(arm, PRIMARY_STALENESS, seed)
        for seed in SEARCH_SEEDS
        for arm in ("sync", "none", "compis")
    ]


def confirm_cells() -> list[Cell]:
    """The confirmatory runs in the protocol's order: the three primary cells seed by seed,
    then every other cell (async arms at S = 1, 4, 8; none and compis at S = 8 with R3 off)
    seed by seed."""
    primary = [
        _cell(arm, PRIMARY_STALENESS, seed)
        for seed in CONFIRM_PRIMARY_SEEDS
        for arm in ("sync", "none", "compis")
    ]
    others = [
        _cell(arm, s, seed)
        for seed in CONFIRM_OTHER_SEEDS
        for s in STALENESS
        for arm in ASYNC_ARMS
        if not (s == PRIMARY_STALENESS and arm in ("none", "compis"))
    ]
    no_r3 = [
        _cell(arm, PRIMARY_STALENESS, seed, replay=False)
        for seed in CONFIRM_OTHER_SEEDS
        for arm in ("none", "compis")
    ]
    return primary + others + no_r3


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadS:
    """Phase 3's workload (amendment 2): the SmolLM2 recipe as shipped, its 40 steps, an
    eval of its held-out prompts before the first step, every 10 steps and after the last."""

    recipe: Path = Path("recipes/smollm2-chain-sum.yaml")
    steps: int = 40
    eval_interval: int = 10
    eval_prompts: int = 64
    eval_samples: int = 4
    flags: tuple[str, ...] = ("--save-hf", "none")
    """Beside the recipe: no Hugging Face export per run (the recipe writes one into a
    directory every run would share)."""


WORKLOAD_S = WorkloadS()


def phase3_staleness(means: Mapping[str, float]) -> int:
    """The staleness at which workload T's async arms (R3 on) differ most: the largest span
    of their mean final held-out pass rates (`means`: the lab's cell name -> mean over seeds;
    cells absent are skipped); `PRIMARY_STALENESS` when no span reaches `DIFFER`. A tie
    goes to the larger staleness."""
    spans = {}
    for s in STALENESS:
        vals = [means[g] for a in ASYNC_ARMS if (g := _cell(a, s, 0).group) in means]
        if len(vals) >= 2:
            spans[s] = max(vals) - min(vals)
    if not spans or max(spans.values()) < DIFFER:
        return PRIMARY_STALENESS
    return max(spans, key=lambda s: (spans[s], s))


def phase3_cells(staleness: int) -> list[Cell]:
    """Phase 3's runs in order: sync, none and compis seed by seed, then tis and is seed by
    seed. Routing replay off: SmolLM2 is dense, it has no routing to replay."""
    primary = [
        _cell(arm, staleness, seed, replay=False)
        for seed in S_PRIMARY_SEEDS
        for arm in ("sync", "none", "compis")
    ]
    others = [
        _cell(arm, staleness, seed, replay=False) for seed in S_OTHER_SEEDS for arm in ("tis", "is")
    ]
    return primary + others


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RegimeOutcome:
    """What the search found in one regime, from its runs' verdicts and final evals."""

    regime: str
    sync_stable: bool
    """Both sync runs judged stable and none ended more than `UNLEARN` below its baseline
    (the regime is eligible; the second half is amendment 1)."""
    none_minus_sync: float
    """Mean over seeds of the paired none − sync final held-out pass rate (NaN if unpaired)."""
    none_unstable: bool
    """A none run judged collapsed or drifting."""

    @property
    def breaks(self) -> bool:
        return self.none_unstable or self.none_minus_sync <= -BREAK_DROP


def choose_regime(outcomes: Sequence[RegimeOutcome]) -> tuple[str, bool]:
    """(the confirmatory regime, whether the uncorrected arm broke there): the first eligible
    regime that breaks, else the last eligible one. Raises when no regime is eligible."""
    eligible = [o for o in outcomes if o.sync_stable]
    if not eligible:
        raise ValueError("no search regime kept both synchronous runs stable")
    for o in eligible:
        if o.breaks:
            return o.regime, True
    return eligible[-1].regime, False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Tost:
    """Two one-sided tests of |mean difference| < margin on paired differences."""

    n: int
    mean: float
    low: float
    """The 90% t-interval's lower end (the 1 − 2α interval of TOST at α = 0.05)."""
    high: float
    equivalent: bool


_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771,
        1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706,
        1.703, 1.701, 1.699, 1.697)  # fmt: skip
"""Student-t 0.95 quantiles for 1..30 degrees of freedom (beyond 30 the last: conservative)."""


def tost(diffs: Sequence[float], margin: float = MARGIN) -> Tost:
    """Equivalence when the 90% t-interval of the mean paired difference lies inside
    (−margin, margin). Needs at least two differences."""
    n = len(diffs)
    if n < 2:
        raise ValueError(f"TOST needs at least 2 paired differences, got {n}")
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(n)
    half = _T95[min(n - 1, len(_T95)) - 1] * se
    low, high = mean - half, mean + half
    return Tost(n=n, mean=mean, low=low, high=high, equivalent=-margin < low and high < margin)


def paired_diffs(
    final: Mapping[str, float], group: str, other: str
) -> tuple[list[int], list[float]]:
    """Seeds run in both cells and the differences `group − other` of `final` (run name ->
    value), in seed order."""
    seeds = sorted(
        int(n.rsplit("-seed", 1)[1])
        for n in final
        if n.rsplit("-seed", 1)[0] == group and f"{other}-seed{n.rsplit('-seed', 1)[1]}" in final
    )
    return seeds, [final[f"{group}-seed{s}"] - final[f"{other}-seed{s}"] for s in seeds]
