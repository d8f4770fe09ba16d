"""Reading a run's metrics.jsonl back into one record per step.

Owns `read_metrics`: tolerant of a torn last line (a run killed mid-write), of several records
for one step (train metrics and eval logged separately, in any order: merged, later keys win)
and of resumed runs. Records with an ``event`` field are not metrics: ``run_start`` (written by
each process before its first step ``s``) drops what an abandoned earlier process logged for
steps >= s, so a resume's replay replaces it; other events (guard warnings) are collected in
`MetricsHistory.events`. Imports nothing from slime_async.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MetricsHistory:
    """A run's metrics, one merged record per step, ordered by step."""

    records: list[dict[str, Any]]
    """Merged records (each has an int ``step``)."""
    bad_lines: int
    """Lines that were not a JSON object with a step (e.g. torn by a kill)."""
    restarts: int
    """Processes that resumed the run (``run_start`` events after the first)."""
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Non-metric records (guard warnings, ...), in file order."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) where ``key`` holds a finite number."""
        steps, values = [], []
        for r in self.records:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                steps.append(r["step"])
                values.append(float(v))
        return steps, values

    def metric_keys(self) -> set[str]:
        """Every metric key that appears in any record."""
        out: set[str] = set()
        for r in self.records:
            out.update(r)
        return out


def read_metrics(path: str | Path) -> MetricsHistory:
    """Read ``metrics.jsonl`` (see the module docstring for the merge rules)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is this a run directory?")
    by_step: dict[int, dict[str, Any]] = {}
    bad = starts = 0
    events: list[dict[str, Any]] = []
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError:
                bad += 1
                continue
            step = rec.get("step") if isinstance(rec, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                bad += 1
                continue
            event = rec.get("event")
            if event == "run_start":
                starts += 1
                # a resume replays from `step`: drop what the abandoned run logged from there on
                by_step = {s: r for s, r in by_step.items() if s < step}
                events = [e for e in events if e["step"] < step]
            elif event is not None:
                events.append(rec)
            else:
                by_step.setdefault(step, {}).update(rec)
    records = [by_step[s] for s in sorted(by_step)]
    return MetricsHistory(
        records=records, bad_lines=bad, restarts=max(0, starts - 1), events=events
    )
