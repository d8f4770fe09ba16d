"""Run metrics: the per-step logger and its sinks, divergence guards, and the JSONL reader.

Public surface: `MetricsLogger` / `MetricsConfig` (logger.py), `LoggingConfig` (config.py: the
wandb and TensorBoard flags), `GuardConfig` / `GuardWarning` /
`GuardMonitor` / `scan` (guards.py), `read_metrics` (history.py). The PNG report lives in
`slime_async.metrics.report` (the dashboard panels in `dashboard.py`); the stability lab's
analysis and outputs are the repository's `lab/` package (not installed), which this package
must never import. This package never imports the trainer, engine, rollout or controller.
"""

from __future__ import annotations

from slime_async.metrics.config import LoggingConfig
from slime_async.metrics.guards import (
    GuardConfig,
    GuardKind,
    GuardMonitor,
    GuardWarning,
    check_step,
    scan,
)
from slime_async.metrics.history import MetricsHistory, read_metrics
from slime_async.metrics.logger import METRICS_FILE, MetricsConfig, MetricsLogger

__all__ = [
    "METRICS_FILE",
    "GuardConfig",
    "GuardKind",
    "GuardMonitor",
    "GuardWarning",
    "LoggingConfig",
    "MetricsConfig",
    "MetricsHistory",
    "MetricsLogger",
    "check_step",
    "read_metrics",
    "scan",
]
