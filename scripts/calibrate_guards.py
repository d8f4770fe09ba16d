"""Calibrate the divergence guards on finished stability-lab runs.

Reads every finished run under each `--out` directory of `scripts/bench_stability.py`, labels
it unstable (drifting or collapsed by `slime_async.metrics.stability`'s verdict rules, the gap's
start taken after the run's staleness bound) or stable, and replays each guard over every run
(`slime_async.metrics.guards.scan`) at every setting of a small grid of its threshold and
window. Prints, per guard and setting, how many unstable and stable runs it fired on, best
separating setting first (hits on unstable runs minus hits on stable ones, as fractions);
`*` marks the settings that fire on at most `lab.MAX_FALSE_ALARMS` of the stable runs (an alarm
that fires on most healthy runs is ignored), and `chosen` is, per guard, the setting
`lab.choose_setting` picks: of the `*` rows within one unstable run of the best separation, the
quietest on stable runs. The defaults in `GuardConfig` are those picks on the runs named in
docs/stability.md#divergence-guards.

    .venv/bin/python scripts/calibrate_guards.py runs/stab runs/stab_lr
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lab import analysis as lab  # noqa: E402
from slime_async.metrics.guards import BASELINE_AFTER_BOUNDS  # noqa: E402
from slime_async.metrics.stability import (  # noqa: E402
    Verdict,
    VerdictRules,
    guard_hits,
    summarize,
    verdict,
)

SKIP_FACTOR = "skip_factor"
"""Not a `GuardConfig` field: the gap baseline is taken after this many times the run's
staleness bound (`diff_baseline_skip` = factor x `staleness_fill_steps`; a run uses
`guards.BASELINE_AFTER_BOUNDS`)."""
SWEEP: dict[str, dict[str, tuple[Any, ...]]] = {
    "rollout_logprob_trend": {
        "trend_min_drop": (0.25, 0.35, 0.4, 0.5),
        "trend_window": (20, 40, 60),
    },
    "logprob_diff_drift": {
        "diff_factor": (2.0, 3.0, 4.0),
        "diff_window": (5, 10, 20),
        "diff_baseline_steps": (5, 10, 20),
        SKIP_FACTOR: (1, 2),
    },
    "entropy_spike": {
        "entropy_factor": (1.5, 2.0),
        "entropy_window": (10, 30),
        "persist_steps": (3, 5),
    },
    "is_weight_range": {"is_upper": (1.1, 1.25), "is_lower": (0.8, 0.9)},
}
"""Guard -> the `GuardConfig` fields swept and their values (every combination)."""


def load(outs: list[str]) -> list[Any]:
    """Every finished run (`result.json` status ok) under the given output directories."""
    runs = []
    for out in outs:
        o = Path(out).resolve()
        cells = [
            lab.Cell(**json.loads((p / lab.RESULT).read_text())["cell"])
            for p in sorted((o / "runs").iterdir())
            if lab.is_done(p)
        ]
        runs += lab.load_runs(o, cells)
    return runs


def _fired(r: Any, setting: dict[str, Any]) -> set[str]:
    """The guards that fire on run `r` with its own guard settings changed by `setting`."""
    fields = dict(setting)
    skip = round(fields.pop(SKIP_FACTOR, BASELINE_AFTER_BOUNDS) * lab.fill_steps(r))
    return guard_hits(
        r.records, dataclasses.replace(lab.run_guards(r), diff_baseline_skip=skip, **fields)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", help="bench_stability.py --out directories")
    a = p.parse_args(argv)
    rules = VerdictRules()
    runs = load(a.outs)
    bad = [
        r
        for r in runs
        if verdict(summarize(r.records, rules, fill_steps=lab.fill_steps(r)), rules)[0]
        is not Verdict.STABLE
    ]
    good = [r for r in runs if r not in bad]
    print(f"{len(bad)} unstable, {len(good)} stable runs: {', '.join(r.cell.name for r in bad)}")
    for kind, fields in SWEEP.items():
        rows = []
        for values in itertools.product(*fields.values()):
            setting = dict(zip(fields, values, strict=True))

            u, s = (sum(kind in _fired(r, setting) for r in group) for group in (bad, good))
            score = u / max(1, len(bad)) - s / max(1, len(good))
            rows.append((score, setting, u, s))
        print(f"\n{kind}")
        for score, setting, u, s in sorted(rows, key=lambda t: -t[0]):
            mark = "*" if s <= lab.MAX_FALSE_ALARMS * len(good) else " "
            print(
                f" {mark}{score:+.2f}  unstable {u}/{len(bad)}  stable {s}/{len(good)}  {setting}"
            )
        pick = lab.choose_setting([(st, u, s) for _, st, u, s in rows], len(bad), len(good))
        print(
            f"chosen (lab.choose_setting): {pick[0] if pick else 'none qualifies'}"
            + (f", unstable {pick[1]}/{len(bad)}, stable {pick[2]}/{len(good)}" if pick else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
