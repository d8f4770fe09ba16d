"""Configuration of the RolloutDataWorker.

Owns `DataWorkerConfig` (one frozen dataclass, every field documented), the
`PartialRolloutPolicy` enum, `validate_config`, which turns bad settings into errors that name the
problem and the fix, and the worker's command-line flags (`add_data_worker_args` /
`data_worker_config_from_args`; every flag default is read from `DataWorkerConfig`). Never
imports `slime_async`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from enum import StrEnum


class ProbeSiblings(StrEnum):
    """What the other n - 1 samples of a group do while its probe (sample 0) runs."""

    QUEUE = "queue"
    """Queue at once at the default expected length; re-ranked when the probe returns."""
    BACKFILL = "backfill"
    """Held back, but dispatched into engine slots that would otherwise stay idle."""
    HOLD = "hold"
    """Held back until the probe returns."""


class PartialRolloutPolicy(StrEnum):
    """What happens to a generation that is aborted (by `pause()` or by the engine)."""

    CONTINUE = "continue"
    """Keep the tokens generated so far (with their per-token versions); resume from them."""
    REQUEUE = "requeue"
    """Discard the partial tokens and re-issue the sample from scratch."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataWorkerConfig:
    """Settings of one RolloutDataWorker (see data_worker/README.md for the algorithm)."""

    n_samples_per_prompt: int = 8
    """Group size n: samples generated per prompt (GRPO group)."""
    groups_per_step: int = 32
    """B: groups consumed by one train step; the unit of the staleness budget."""
    max_staleness: int = 2
    """S: admit a group only while admitted groups < (S + v + 1) * B; S = 0 is synchronous."""
    fifo_window: float | None = None
    """W: only completed groups with seq in [head, head + W) are consumable; 1 = strict order,
    `math.inf` = arrival order, None = 2 * groups_per_step. Worst-case staleness is
    S + ceil((W - 1) / B)."""
    max_off_policy_steps: int | None = None
    """Drop groups with k - j_min > this at consumption (None: never drop)."""
    partial_rollout: PartialRolloutPolicy = PartialRolloutPolicy.CONTINUE
    """On abort: `continue` keeps partial tokens and resumes, `requeue` re-issues from scratch."""
    length_probe: bool = True
    """Probe dispatch: unknown prompts send sample 0 first; the rest follow longest-first.
    False: every sample is dispatched at once in submission (FIFO) order."""
    probe_siblings: ProbeSiblings = ProbeSiblings.QUEUE
    """While a probe runs, its group's other samples are `queue`d at the default length and
    re-ranked when it returns, `backfill`ed into idle slots only, or `hold` until it returns."""
    length_ema_alpha: float = 0.5
    """Weight of a new response length in the per-prompt EMA (1.0 = keep only the latest)."""
    default_expected_len: int = 1024
    """Expected response length passed to `generate` for prompts never seen before."""
    max_inflight: int = 256
    """Most generate calls running at once (set to the engines' total concurrent slots)."""
    max_queued_samples: int | None = None
    """New prompts are admitted only while fewer samples than this wait for dispatch
    (None: max_inflight). The staleness budget applies on top of this."""
    priority_bucket_groups: int | None = None
    """Longest-first ordering applies within buckets of this many consecutive groups; older
    buckets go first, so short old groups cannot starve (None: groups_per_step)."""
    max_generate_retries: int = 3
    """A sample whose `generate` raises more than this many times fails the worker."""

    def __post_init__(self) -> None:
        if self.fifo_window is None and isinstance(self.groups_per_step, int):
            object.__setattr__(self, "fifo_window", 2 * self.groups_per_step)
        validate_config(self)

    @property
    def queued_limit(self) -> int:
        """Effective `max_queued_samples`."""
        return self.max_inflight if self.max_queued_samples is None else self.max_queued_samples

    @property
    def bucket_groups(self) -> int:
        """Effective `priority_bucket_groups`."""
        b = self.priority_bucket_groups
        return self.groups_per_step if b is None else b


def validate_config(cfg: DataWorkerConfig) -> None:
    """Raise ValueError naming the bad field and how to fix it."""
    if not isinstance(cfg.n_samples_per_prompt, int) or cfg.n_samples_per_prompt < 1:
        raise ValueError(
            f"n_samples_per_prompt must be an integer >= 1, got {cfg.n_samples_per_prompt!r}; "
            "set --n-samples-per-prompt to the group size (e.g. 8)."
        )
    if not isinstance(cfg.groups_per_step, int) or cfg.groups_per_step < 1:
        raise ValueError(
            f"groups_per_step (B) must be an integer >= 1, got {cfg.groups_per_step!r}; "
            "it is the number of prompt groups one train step consumes."
        )
    if not isinstance(cfg.max_staleness, int) or cfg.max_staleness < 0:
        raise ValueError(
            f"max_staleness (S) must be an integer >= 0, got {cfg.max_staleness!r}; "
            "use 0 for synchronous training, 1 for one-step off-policy, >1 for fully async."
        )
    w = cfg.fifo_window
    if (
        w is None
        or isinstance(w, bool)
        or not isinstance(w, (int, float))
        or math.isnan(w)
        or w < 1
    ):
        raise ValueError(
            f"fifo_window (W) must be >= 1 or math.inf, got {w!r}; "
            "use 1 for strict submission order, math.inf for arrival order."
        )
    if not math.isinf(w) and w != int(w):
        raise ValueError(
            f"fifo_window (W) must be a whole number of groups or math.inf, got {w!r}."
        )
    m = cfg.max_off_policy_steps
    if m is not None and (not isinstance(m, int) or m < 0):
        raise ValueError(
            f"max_off_policy_steps must be None (never drop) or an integer >= 0, got {m!r}."
        )
    if not isinstance(cfg.partial_rollout, PartialRolloutPolicy):
        try:
            PartialRolloutPolicy(cfg.partial_rollout)
        except ValueError:
            raise ValueError(
                f"partial_rollout must be 'continue' or 'requeue', got {cfg.partial_rollout!r}."
            ) from None
        object.__setattr__(cfg, "partial_rollout", PartialRolloutPolicy(cfg.partial_rollout))
    if not isinstance(cfg.probe_siblings, ProbeSiblings):
        try:
            object.__setattr__(cfg, "probe_siblings", ProbeSiblings(cfg.probe_siblings))
        except ValueError:
            raise ValueError(
                f"probe_siblings must be 'queue', 'backfill' or 'hold', got {cfg.probe_siblings!r}."
            ) from None
    if not 0.0 < cfg.length_ema_alpha <= 1.0:
        raise ValueError(f"length_ema_alpha must be in (0, 1], got {cfg.length_ema_alpha!r}.")
    if not isinstance(cfg.default_expected_len, int) or cfg.default_expected_len < 1:
        raise ValueError(
            f"default_expected_len must be an integer >= 1, got {cfg.default_expected_len!r}; "
            "use a typical response length in tokens."
        )
    if not isinstance(cfg.max_inflight, int) or cfg.max_inflight < 1:
        raise ValueError(
            f"max_inflight must be an integer >= 1, got {cfg.max_inflight!r}; "
            "set it to the engines' total concurrent request slots."
        )
    q = cfg.max_queued_samples
    if q is not None and (not isinstance(q, int) or q < 1):
        raise ValueError(f"max_queued_samples must be None or an integer >= 1, got {q!r}.")
    b = cfg.priority_bucket_groups
    if b is not None and (not isinstance(b, int) or b < 1):
        raise ValueError(f"priority_bucket_groups must be None or an integer >= 1, got {b!r}.")
    if not isinstance(cfg.max_generate_retries, int) or cfg.max_generate_retries < 0:
        raise ValueError(
            f"max_generate_retries must be an integer >= 0, got {cfg.max_generate_retries!r}."
        )


def add_data_worker_args(parser: argparse.ArgumentParser) -> None:
    """Add the async-schedule flags the data worker owns (defaults from `DataWorkerConfig`)."""
    g = parser.add_argument_group("async schedule and staleness (data worker)")
    d = DataWorkerConfig()
    g.add_argument("--max-staleness", type=int, default=d.max_staleness,
                   help="S: 0 synchronous, 1 one-step off-policy, >1 fully async.")  # fmt: skip
    g.add_argument(
        "--fifo-window",
        type=float,
        default=None,
        help="W: completed groups consumable within [head, head+W); 1 strict order, "
        "inf arrival order (default: 2 x groups per step).",
    )
    g.add_argument(
        "--max-off-policy-steps",
        type=int,
        default=d.max_off_policy_steps,
        help="Drop groups with k - j_min > N before training (default: never).",
    )
    g.add_argument(
        "--partial-rollout",
        choices=[p.value for p in PartialRolloutPolicy],
        nargs="?",
        const=PartialRolloutPolicy.CONTINUE.value,
        default=d.partial_rollout.value,
        help="At weight sync: continue partial rollouts (per-token versions) or "
        "requeue them whole; bare --partial-rollout (slime's switch) = continue.",
    )
    g.add_argument(
        "--no-length-probe",
        dest="length_probe",
        action="store_false",
        default=d.length_probe,
        help="Disable length-probe dispatch (dispatch every sample at once).",
    )
    g.add_argument("--max-inflight", type=int, default=d.max_inflight,
                   help="Most concurrent generate requests.")  # fmt: skip


def data_worker_config_from_args(
    args: argparse.Namespace,
    *,
    n_samples_per_prompt: int,
    groups_per_step: int,
    default_expected_len: int,
) -> DataWorkerConfig:
    """Build the config from `add_data_worker_args` flags plus the batch shape (owned by the
    rollout settings of the caller)."""
    w = args.fifo_window
    if w is not None and not math.isinf(w) and w == int(w):
        w = int(w)
    return DataWorkerConfig(
        n_samples_per_prompt=n_samples_per_prompt,
        groups_per_step=groups_per_step,
        max_staleness=args.max_staleness,
        fifo_window=w,
        max_off_policy_steps=args.max_off_policy_steps,
        partial_rollout=PartialRolloutPolicy(args.partial_rollout),
        length_probe=args.length_probe,
        default_expected_len=default_expected_len,
        max_inflight=args.max_inflight,
    )
