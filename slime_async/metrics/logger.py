"""The run's metric logger: one dict per step, validated, fanned out to the sinks, guarded.

Owns `MetricsConfig`, `MetricsLogger` and `set_aside_previous_run` (a fresh run in a reused run
directory never appends to an earlier run's metrics or resumes its wandb run). ``log(step, metrics)`` checks the keys (namespaced
``group/name``) and values (numbers, lists of numbers for histograms, or None), stamps the step
and wall time, writes the record to every sink (``RUN_DIR/metrics.jsonl`` always), feeds the
divergence guards and prints their warnings (also written to the JSONL as ``event: guard``
records). Several calls for one step (train metrics, then eval) are fine: the JSONL reader merges
them. Imports nothing from slime_async outside this package.

Example::

    with MetricsLogger("runs/demo", total_steps=100) as ml:
        for step in range(1, 101):
            ml.log(step, {"rollout/reward": r, "policy/entropy": h, "timing/step_s": dt})
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from slime_async.metrics.config import LoggingConfig
from slime_async.metrics.guards import GuardConfig, GuardMonitor, GuardWarning
from slime_async.metrics.sinks import (
    WANDB_RUN_ID_FILE,
    ConsoleSink,
    JsonlSink,
    ProgressBar,
    Sink,
    TensorBoardSink,
    WandbSink,
)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
"""File name of the JSONL log inside the run directory."""
PER_RUN = (METRICS_FILE, WANDB_RUN_ID_FILE, "tensorboard")
"""What one run logs into its run directory, and a fresh run there sets aside."""


def set_aside_previous_run(run_dir: str | Path) -> list[tuple[Path, Path]]:
    """A fresh run (not resuming) in a run directory that holds an earlier run's logs: each of
    `PER_RUN` there (its metrics.jsonl, its wandb run id, its TensorBoard events) is moved to
    `<name>.stale-<UTC time>` (the prompt ledger's convention), so nothing is lost and this run
    neither appends to its metrics nor resumes its wandb run. Returns the (old, new) paths."""
    root = Path(run_dir)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    moved = []
    for name in PER_RUN:
        path = root / name
        if not path.exists():
            continue
        dest, n = path.with_name(f"{name}.stale-{stamp}"), 0
        while dest.exists():
            n += 1
            dest = path.with_name(f"{name}.stale-{stamp}-{n}")
        path.rename(dest)
        moved.append((path, dest))
    return moved


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MetricsConfig:
    """What the metric logger writes where."""

    console: bool = True
    """Print one short line per logged step on stdout."""
    console_every: int = 1
    """Print every N-th step only (eval records always print)."""
    progress: bool = True
    """Draw a progress bar on stderr (needs total_steps for the bar and ETA)."""
    loggers: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """External loggers: wandb and TensorBoard (`--use-wandb`, `--wandb-*`, `--use-tensorboard`)."""
    guards: GuardConfig | None = dataclasses.field(default_factory=GuardConfig)
    """Divergence-guard thresholds; None disables the live guards."""

    def __post_init__(self) -> None:
        if self.console_every < 1:
            raise ValueError(f"console_every must be >= 1, got {self.console_every}")


def _clean_value(key: str, v: Any) -> Any:
    if v is None or isinstance(v, bool):
        return None if v is None else float(v)
    if isinstance(v, numbers.Real):
        return float(v) if not isinstance(v, int) else int(v)
    if hasattr(v, "tolist") and not isinstance(v, (list, tuple, str)):  # numpy, torch
        return _clean_value(key, v.tolist())
    if isinstance(v, (list, tuple)):
        out = [_clean_value(key, x) for x in v]
        if any(isinstance(x, list) for x in out):
            raise ValueError(f"metric {key!r}: nested lists are not supported")
        return out
    raise TypeError(
        f"metric {key!r} has a {type(v).__name__} value; log numbers, lists of numbers or None"
    )


def clean_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Validate and normalize one step's metrics (raises naming the bad key)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or "/" not in k or k.startswith("/") or k.endswith("/"):
            raise ValueError(
                f"metric key {k!r} is not namespaced; use 'group/name' such as 'rollout/reward'"
            )
        out[k] = _clean_value(k, v)
    return out


class MetricsLogger:
    """Fan-out of per-step metric dicts to the configured sinks, with live divergence guards."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int | None = None,
        config: MetricsConfig | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        extra_sinks: list[Sink] | None = None,
        run_config: Mapping[str, Any] | None = None,
        resume: bool = True,
        **overrides: Any,
    ) -> None:
        """``overrides`` are `MetricsConfig` or `LoggingConfig` fields (e.g.
        ``use_tensorboard=True``); ``run_config`` (the run's config.json record) is sent as the
        wandb run's config. ``resume=False`` (a fresh run): an earlier run's logs in
        ``run_dir`` are set aside first (`set_aside_previous_run`, said on the log), so this
        run neither appends to its metrics.jsonl nor continues its wandb run; ``resume=True``
        (a run resumed from --load) continues both."""
        if not resume:
            for old, new in set_aside_previous_run(run_dir):
                log.warning(
                    "%s holds an earlier run's %s; this run starts fresh (no --load), so it "
                    "logs anew and the old one was moved to %s. To continue the earlier run "
                    "instead, stop and pass --load <its --save directory>.",
                    run_dir,
                    old.name,
                    new.name,
                )
        cfg = config or MetricsConfig()
        logging_fields = {f.name for f in dataclasses.fields(LoggingConfig)}
        to_loggers = {k: v for k, v in overrides.items() if k in logging_fields}
        overrides = {k: v for k, v in overrides.items() if k not in logging_fields}
        if to_loggers:
            overrides["loggers"] = dataclasses.replace(cfg.loggers, **to_loggers)
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        self.config = cfg
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self._stderr = stderr
        self.jsonl = JsonlSink(self.run_dir / METRICS_FILE)
        self.sinks: list[Sink] = [self.jsonl]
        if cfg.console:
            self.sinks.append(
                ConsoleSink(stream=stdout, every=cfg.console_every, total_steps=total_steps)
            )
        lc = cfg.loggers
        if lc.use_tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        if lc.use_wandb:
            self.sinks.append(
                WandbSink(
                    run_dir=self.run_dir,
                    project=lc.wandb_project,
                    entity=lc.wandb_team,
                    group=lc.wandb_group,
                    run_id=lc.wandb_run_id,
                    mode=lc.wandb_mode,
                    wandb_dir=lc.wandb_dir,
                    host=lc.wandb_host,
                    config=run_config,
                )
            )
        self.sinks.extend(extra_sinks or [])
        self.monitor = GuardMonitor(cfg.guards) if cfg.guards is not None else None
        self.progress: ProgressBar | None = None
        self.warnings: list[GuardWarning] = []
        self._started = False
        self._last_guarded: int | None = None
        self._closed = False

    # ------------------------------------------------------------------ logging
    def log(self, step: int, metrics: Mapping[str, Any]) -> list[GuardWarning]:
        """Record the metrics of ``step``; returns the guard warnings printed for it."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        clean = clean_metrics(metrics)
        if not self._started:
            self._start(step)
        record = {"step": step, "time": time.time(), **clean}
        if self.progress is not None:
            self.progress.clear()
        for sink in self.sinks:
            sink.write(record)
        fired: list[GuardWarning] = []
        # guards read train records only, once per step, in step order; eval records (which
        # the controller may log late, from a concurrent task) never feed them
        is_train = any(not k.startswith("eval/") and k != "timing/eval_s" for k in clean)
        if (
            self.monitor is not None
            and is_train
            and (self._last_guarded is None or step > self._last_guarded)
        ):
            self._last_guarded = step
            fired = self.monitor.update(record)
            for w in fired:
                self._warn(w)
        if self.progress is not None:
            self.progress.update(step)
        return fired

    def _start(self, step: int) -> None:
        self._started = True
        self.jsonl.write({"step": step, "event": "run_start", "time": time.time()})
        if self.config.progress:
            self.progress = ProgressBar(self.total_steps, stream=self._stderr, start_step=step)

    def _warn(self, w: GuardWarning) -> None:
        self.warnings.append(w)
        print(
            f"WARNING step {w.step} [{w.kind}]: {w.message}",
            file=self._stderr or sys.stderr,
            flush=True,
        )
        self.jsonl.write(
            {
                "step": w.step,
                "event": "guard",
                "kind": str(w.kind),
                "key": w.key,
                "value": w.value if math.isfinite(w.value) else None,
                "threshold": w.threshold,
                "message": w.message,
                "time": time.time(),
            }
        )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.progress is not None:
            self.progress.close()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # closing: report and close the rest
                log.warning("metrics sink %s did not close cleanly: %s", type(sink).__name__, e)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
