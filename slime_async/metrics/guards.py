"""Divergence guards: checks over the metric history that return warnings.

One responsibility, the guards themselves (their pure detectors are `detectors.py`'s). Owns
`GuardConfig` (the thresholds, their one set of defaults; `run_guard_config` fits it to a
run's typed `DataWorkerConfig`, `saved_run_guard_config` to the one a run saved in its
config.json), `GuardKind`, `GuardWarning`, `check_step` (all guards at one step), `scan` (every
step, for the report) and `GuardMonitor` (the live, de-duplicating wrapper the metric logger
uses). The thresholds and their rationale are in ``metrics/README.md``. Imports nothing from
slime_async but this package (and the `data_worker` leaf's config and staleness bound).

Non-finite values (NaN, inf, missing) are ignored by every detector: a guard fires on evidence,
never on absence of data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clifields import StrEnum
from slime_async.metrics.detectors import (
    entropy_spike,
    finite,
    is_weight_out_of_range,
    logprob_diff_drift,
    trend_drop,
    window_mean_below,
)

if TYPE_CHECKING:
    from data_worker.config import DataWorkerConfig

IS_SOURCES = ("staleness", "engine", "combined")
"""Sources whose IS weight mean `is/<source>/mean` is range-checked by default."""


class GuardKind(StrEnum):
    """Which signal crossed its threshold."""

    ENTROPY_SPIKE = "entropy_spike"
    LOGPROB_DIFF_DRIFT = "logprob_diff_drift"
    IS_WEIGHT_RANGE = "is_weight_range"
    ROLLOUT_LOGPROB_TREND = "rollout_logprob_trend"
    IS_ESS_LOW = "is_ess_low"
    GRAD_COSINE_LOW = "grad_cosine_low"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """Thresholds of the divergence guards (see metrics/README.md). The defaults are the
    stability lab's calibration (docs/stability.md#divergence-guards,
    scripts/calibrate_guards.py, `lab.analysis.choose_setting`): per guard, of the settings
    firing on at most a third of the stable runs and within one unstable run of the best
    separation, the one firing on the fewest stable runs."""

    entropy_key: str = "policy/entropy"
    """Metric checked for spikes."""
    entropy_window: int = 30
    """Trailing steps whose median is the entropy reference."""
    entropy_factor: float = 2.0
    """Spike when entropy > factor x trailing median ..."""
    entropy_min_delta: float = 0.1
    """... and exceeds that median by at least this many nats."""
    diff_key: str = "mismatch/train_rollout_logprob_abs_diff"
    """Train/rollout log-prob mismatch metric."""
    diff_baseline_steps: int = 5
    """First finite values (after `diff_baseline_skip`) whose median is the baseline."""
    diff_baseline_skip: int = 0
    """Steps skipped before the baseline is taken. An async run's gap rises while its
    staleness budget fills (the first steps train near-on-policy samples), which is staleness
    arriving, not drift: the run sets this to `BASELINE_AFTER_BOUNDS` times its staleness
    bound `S + ceil((W - 1) / B)` (`run_guard_config`)."""
    diff_window: int = 20
    """Recent values averaged before comparing with the baseline."""
    diff_factor: float = 4.0
    """Drift when the recent mean > factor x baseline ..."""
    diff_min: float = 0.005
    """... and is above this absolute level (tiny diffs doubling is noise)."""
    is_sources: tuple[str, ...] = IS_SOURCES
    """IS sources whose weight mean must stay inside [is_lower, is_upper]."""
    is_lower: float = 0.9
    """Lower bound of a healthy per-source IS weight mean."""
    is_upper: float = 1.25
    """Upper bound of a healthy per-source IS weight mean."""
    trend_key: str = "rollout/logprob_mean"
    """Mean log-prob of sampled tokens; a steady fall means the policy is losing confidence."""
    trend_window: int = 40
    """Steps over which the least-squares trend is fitted."""
    trend_min_drop: float = 0.4
    """Trend when the fitted fall across the window exceeds this many nats per token (the
    healthy default run wanders by up to ~0.2; its lr=1e-3 collapse fell ~1.0)."""
    ess_sources: tuple[str, ...] = IS_SOURCES
    """IS sources whose effective sample size `is/<source>/ess` (a fraction of the tokens,
    (Σw)² / (N·Σw²)) is watched: weights concentrating on few tokens mean the batch's
    gradient rests on those few."""
    ess_window: int = 5
    """Steps averaged before comparing the ESS with its floor."""
    ess_floor: float = 0.7
    """Warn when a source's mean ESS over the window falls below this (the staleness sweep's
    calibration: ahead of 12 of its 15 unstable runs, on none of its sync runs)."""
    grad_cosine_window: int = 5
    """Steps averaged before comparing the gradient cosine with its floor."""
    grad_cosine_floor: float = -0.2
    """Warn when the mean cosine between consecutive steps' gradients (`train/grad_cosine`)
    over the window falls below this: successive updates undoing each other. No setting
    separated the staleness sweep's unstable runs from its healthy ones; at this one it fired on
    none of them."""
    persist_steps: int = 3
    """A guard is reported only once it has fired on this many consecutive steps: with small
    batches one noisy step (an entropy blip) is not a divergence."""

    def __post_init__(self) -> None:
        if (
            min(
                self.entropy_window,
                self.diff_baseline_steps,
                self.diff_window,
                self.persist_steps,
                self.ess_window,
                self.grad_cosine_window,
            )
            < 1
        ):
            raise ValueError("guard windows must be >= 1")
        if self.diff_baseline_skip < 0:
            raise ValueError(f"diff_baseline_skip must be >= 0, got {self.diff_baseline_skip}")
        if self.trend_window < 3:
            raise ValueError(f"trend_window must be >= 3, got {self.trend_window}")
        if not 0.0 < self.is_lower < 1.0 < self.is_upper:
            raise ValueError(
                f"need 0 < is_lower < 1 < is_upper, got [{self.is_lower}, {self.is_upper}]"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GuardWarning:
    """One guard firing at one step."""

    kind: GuardKind
    """Which guard."""
    step: int
    """Train step at which it fired."""
    key: str
    """Metric that crossed the threshold."""
    value: float
    """The offending value."""
    threshold: float
    """The threshold it crossed."""
    message: str
    """A sentence for the console."""


def staleness_fill_steps(data_worker: DataWorkerConfig) -> int:
    """`GuardConfig.diff_baseline_skip` for a run: its staleness bound
    (`data_worker.budget.staleness_bound`: `S + ceil((W - 1) / B)` capped by
    `max_off_policy_steps`, for any push interval) from its data worker's settings; `S + 1`
    when the window is unbounded and nothing caps it."""
    from data_worker.budget import staleness_bound

    s = data_worker.max_staleness
    bound = staleness_bound(
        max_staleness=s,
        fifo_window=data_worker.fifo_window,
        groups_per_step=data_worker.groups_per_step,
        max_off_policy_steps=data_worker.max_off_policy_steps,
    )
    return int(bound) if math.isfinite(bound) else s + 1


BASELINE_AFTER_BOUNDS = 2
"""The gap baseline is taken after this many staleness bounds. The first bound's worth of steps
does not settle the staleness: the lab's runs drain the queue and refill it once (staleness
0, 1, ..., S, then 0, 1, ... again) before it holds near S, between one and two bounds in.
A baseline taken in that refill is too low, and the steady gap read as drift (the lab's
calibration, docs/stability.md#divergence-guards)."""


def run_guard_config(data_worker: DataWorkerConfig) -> GuardConfig:
    """The guards a run applies: the defaults, with the gap baseline taken once its staleness
    settled: `BASELINE_AFTER_BOUNDS` x `staleness_fill_steps` of its data-worker settings."""
    return GuardConfig(diff_baseline_skip=BASELINE_AFTER_BOUNDS * staleness_fill_steps(data_worker))


def saved_data_worker(config: Mapping[str, Any]) -> DataWorkerConfig | None:
    """The data worker's settings in a run's saved config.json (its `data_worker` section read
    back by `data_worker_config_from_record`: a field an older file lacks takes the dataclass
    default); None when the file holds no such section."""
    from data_worker.config import data_worker_config_from_record

    section = config.get("data_worker")
    return None if section is None else data_worker_config_from_record(section)


def saved_run_guard_config(config: Mapping[str, Any]) -> GuardConfig:
    """The guards a run applied, from its saved config.json: `run_guard_config` of its data
    worker's settings; the thresholds alone (no gap baseline skipped) when it saved none."""
    dw = saved_data_worker(config)
    return GuardConfig() if dw is None else run_guard_config(dw)


# ---------------------------------------------------------------------------- composition
def _series(history: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
    return [rec.get(key) for rec in history]


def early_values(
    history: Sequence[Mapping[str, Any]], key: str, n: int, *, skip: int = 0
) -> list[float]:
    """The first ``n`` finite values of ``key`` after the first ``skip`` records (fewer if the
    history has fewer)."""
    out: list[float] = []
    for rec in history[skip:]:
        out.extend(finite([rec.get(key)]))
        if len(out) >= n:
            break
    return out[:n]


def check_step(
    history: Sequence[Mapping[str, Any]],
    cfg: GuardConfig,
    *,
    diff_baseline: Sequence[float] | None = None,
    num_records: int | None = None,
) -> list[GuardWarning]:
    """All guards evaluated at the last record of ``history`` (records ordered by step).

    Only the tail of ``history`` is read, plus its head for the log-prob-diff baseline unless
    ``diff_baseline`` (the first finite values of that metric) is given; ``num_records`` is
    the run's record count when ``history`` is only its tail.
    """
    if not history:
        return []
    step = int(history[-1].get("step", len(history) - 1))
    total = len(history) if num_records is None else num_records
    out = [
        _entropy_warning(history, cfg, step),
        _diff_warning(history, cfg, step, diff_baseline=diff_baseline, total=total),
        *_is_warnings(history[-1], cfg, step),
        _trend_warning(history, cfg, step),
        *_ess_warnings(history, cfg, step),
        _grad_cosine_warning(history, cfg, step),
    ]
    return [w for w in out if w is not None]


def _warning(
    kind: GuardKind, step: int, key: str, hit: tuple[float, float], message: str
) -> GuardWarning:
    return GuardWarning(
        kind=kind, step=step, key=key, value=hit[0], threshold=hit[1], message=message
    )


def _entropy_warning(
    history: Sequence[Mapping[str, Any]], cfg: GuardConfig, step: int
) -> GuardWarning | None:
    """`entropy_spike` at the last record, if its entropy is logged."""
    if history[-1].get(cfg.entropy_key) is None:
        return None
    hit = entropy_spike(
        _series(history[-(cfg.entropy_window + 1) :], cfg.entropy_key),
        window=cfg.entropy_window,
        factor=cfg.entropy_factor,
        min_delta=cfg.entropy_min_delta,
    )
    if not hit:
        return None
    return _warning(
        GuardKind.ENTROPY_SPIKE,
        step,
        cfg.entropy_key,
        hit,
        f"entropy spiked to {hit[0]:.3g} (threshold {hit[1]:.3g} from the "
        f"trailing {cfg.entropy_window}-step median)",
    )


def _diff_warning(
    history: Sequence[Mapping[str, Any]],
    cfg: GuardConfig,
    step: int,
    *,
    diff_baseline: Sequence[float] | None,
    total: int,
) -> GuardWarning | None:
    """`logprob_diff_drift` at the last record, once a full baseline and a full window of
    ``total`` records (the run's count) lie behind it."""
    if history[-1].get(cfg.diff_key) is None:
        return None
    if diff_baseline is None:
        diff_baseline = early_values(
            history, cfg.diff_key, cfg.diff_baseline_steps, skip=cfg.diff_baseline_skip
        )
    n_base = len(diff_baseline)
    if n_base != cfg.diff_baseline_steps or total < (
        cfg.diff_baseline_skip + n_base + cfg.diff_window
    ):
        return None
    hit = logprob_diff_drift(
        diff_baseline,
        _series(history[-cfg.diff_window :], cfg.diff_key),
        factor=cfg.diff_factor,
        min_abs=cfg.diff_min,
    )
    if not hit:
        return None
    return _warning(
        GuardKind.LOGPROB_DIFF_DRIFT,
        step,
        cfg.diff_key,
        hit,
        f"train/rollout log-prob diff drifted to {hit[0]:.3g}, above "
        f"{hit[1]:.3g} ({cfg.diff_factor:g}x its early baseline)",
    )


def _is_warnings(record: Mapping[str, Any], cfg: GuardConfig, step: int) -> list[GuardWarning]:
    """`is_weight_out_of_range` of each IS source's weight mean in ``record``."""
    out = []
    for source in cfg.is_sources:
        key = f"is/{source}/mean"
        hit = is_weight_out_of_range(record.get(key), lower=cfg.is_lower, upper=cfg.is_upper)
        if hit:
            out.append(
                _warning(
                    GuardKind.IS_WEIGHT_RANGE,
                    step,
                    key,
                    hit,
                    f"{source} IS weight mean {hit[0]:.3g} left "
                    f"[{cfg.is_lower:g}, {cfg.is_upper:g}]",
                )
            )
    return out


def _trend_warning(
    history: Sequence[Mapping[str, Any]], cfg: GuardConfig, step: int
) -> GuardWarning | None:
    """`trend_drop` over the last `trend_window` records, if the last logs the trend key."""
    if history[-1].get(cfg.trend_key) is None:
        return None
    hit = trend_drop(
        _series(history[-cfg.trend_window :], cfg.trend_key),
        window=cfg.trend_window,
        min_drop=cfg.trend_min_drop,
    )
    if not hit:
        return None
    return _warning(
        GuardKind.ROLLOUT_LOGPROB_TREND,
        step,
        cfg.trend_key,
        hit,
        f"rollout log-prob fell {hit[0]:.3g} nats/token over the last "
        f"{cfg.trend_window} steps (threshold {hit[1]:g})",
    )


def _ess_warnings(
    history: Sequence[Mapping[str, Any]], cfg: GuardConfig, step: int
) -> list[GuardWarning]:
    """`window_mean_below` of each watched source's ESS, if the last record logs it."""
    out = []
    for source in cfg.ess_sources:
        key = f"is/{source}/ess"
        if history[-1].get(key) is None:
            continue
        hit = window_mean_below(
            _series(history[-cfg.ess_window :], key), window=cfg.ess_window, floor=cfg.ess_floor
        )
        if hit:
            out.append(
                _warning(
                    GuardKind.IS_ESS_LOW,
                    step,
                    key,
                    hit,
                    f"{source} IS weights' effective sample size {hit[0]:.3g} of the tokens "
                    f"(mean of {cfg.ess_window} steps), below {cfg.ess_floor:g}",
                )
            )
    return out


GRAD_COSINE_KEY = "train/grad_cosine"


def _grad_cosine_warning(
    history: Sequence[Mapping[str, Any]], cfg: GuardConfig, step: int
) -> GuardWarning | None:
    """`window_mean_below` of the consecutive-gradient cosine, if the last record logs it."""
    if history[-1].get(GRAD_COSINE_KEY) is None:
        return None
    hit = window_mean_below(
        _series(history[-cfg.grad_cosine_window :], GRAD_COSINE_KEY),
        window=cfg.grad_cosine_window,
        floor=cfg.grad_cosine_floor,
    )
    if not hit:
        return None
    return _warning(
        GuardKind.GRAD_COSINE_LOW,
        step,
        GRAD_COSINE_KEY,
        hit,
        f"consecutive gradients' cosine {hit[0]:.3g} (mean of {cfg.grad_cosine_window} steps), "
        f"below {cfg.grad_cosine_floor:g}: updates are undoing each other",
    )


def _tail_len(cfg: GuardConfig) -> int:
    return max(
        cfg.entropy_window + 1,
        cfg.trend_window,
        cfg.diff_window,
        cfg.ess_window,
        cfg.grad_cosine_window,
    )


def scan(history: Sequence[Mapping[str, Any]], cfg: GuardConfig) -> list[GuardWarning]:
    """Every warning at every step of a finished run (records ordered by step)."""
    tail = _tail_len(cfg)
    base: list[float] = []
    out: list[GuardWarning] = []
    streak: dict[tuple[GuardKind, str], int] = {}
    for i, rec in enumerate(history):
        if i >= cfg.diff_baseline_skip and len(base) < cfg.diff_baseline_steps:
            base.extend(finite([rec.get(cfg.diff_key)]))
        window = history[max(0, i + 1 - tail) : i + 1]
        fired = check_step(window, cfg, diff_baseline=list(base), num_records=i + 1)
        streak = _streaks(streak, fired)
        out.extend(w for w in fired if streak[(w.kind, w.key)] >= cfg.persist_steps)
    return out


def _streaks(
    prev: Mapping[tuple[GuardKind, str], int], fired: Sequence[GuardWarning]
) -> dict[tuple[GuardKind, str], int]:
    """Consecutive-step counts of each guard that fired now (others reset to 0)."""
    return {(w.kind, w.key): prev.get((w.kind, w.key), 0) + 1 for w in fired}


class GuardMonitor:
    """Live guards: feed one record per step, get the warnings worth printing.

    A guard is reported when it starts firing (or when an IS source starts leaving its range),
    then again every ``repeat_every`` steps while it keeps firing, so a persistent problem stays
    visible without flooding the console.

    Example::

        mon = GuardMonitor(GuardConfig())
        for rec in records:              # {"step": k, "policy/entropy": ..., ...}
            for w in mon.update(rec):
                print("WARNING", w.message)
    """

    def __init__(self, config: GuardConfig | None = None, *, repeat_every: int = 20) -> None:
        self.config = config or GuardConfig()
        self.repeat_every = repeat_every
        self.history: list[dict[str, Any]] = []
        self._last_reported: dict[tuple[GuardKind, str], int] = {}
        self._firing: set[tuple[GuardKind, str]] = set()
        self._baseline: list[float] = []
        self._count = 0
        self._streak: dict[tuple[GuardKind, str], int] = {}

    def update(self, record: Mapping[str, Any]) -> list[GuardWarning]:
        """Add the record of the newest step; return warnings to show now."""
        cfg = self.config
        step = record.get("step")
        if self.history and step is not None and step <= self.history[-1].get("step", -1):
            # a resumed run replays steps: forget the abandoned future
            self.history = [r for r in self.history if r.get("step", -1) < step]
        self.history.append(dict(record))
        self._count += 1
        if self._count > cfg.diff_baseline_skip and len(self._baseline) < cfg.diff_baseline_steps:
            self._baseline.extend(finite([record.get(cfg.diff_key)]))
        self.history = self.history[-_tail_len(cfg) :]  # all any guard reads
        fired = check_step(
            self.history, cfg, diff_baseline=list(self._baseline), num_records=self._count
        )
        self._streak = _streaks(self._streak, fired)
        warnings = [w for w in fired if self._streak[(w.kind, w.key)] >= cfg.persist_steps]
        now = {(w.kind, w.key) for w in warnings}
        out = []
        for w in warnings:
            ident = (w.kind, w.key)
            last = self._last_reported.get(ident)
            if ident not in self._firing or last is None or w.step - last >= self.repeat_every:
                out.append(w)
                self._last_reported[ident] = w.step
        self._firing = now
        return out
