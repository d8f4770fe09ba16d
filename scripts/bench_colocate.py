"""Colocated mode (slime's `--colocate`): what a turn costs and what it frees, measured.

Runs the embedded default with `--colocate` for `--steps` train steps (in-process, a fresh run
directory under `--out`) and reads the run's turn log (`colocate.jsonl`): per step, the seconds
the engines take to release (SGLang's /release_memory_occupation through the router) and to
resume, the seconds the trainer takes to onload and to offload, the trainer's resident memory
freed by each offload (measured in the trainer actor, /proc VmRSS) against the bytes it
offloaded, and the weight bytes each engine released. Prints one JSON summary and writes it to
`<out>/summary.json`.

    nice -n 10 .venv/bin/python scripts/bench_colocate.py --steps 6
    nice -n 10 .venv/bin/python scripts/bench_colocate.py -- --max-staleness 1   # extra flags
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slime_async.config import parse_config  # noqa: E402
from slime_async.orchestrator.colocate import read_events  # noqa: E402
from slime_async.orchestrator.controller import train  # noqa: E402


def _argv(run_dir: Path, steps: int, extra: list[str]) -> list[str]:
    return [
        *("--run-dir", str(run_dir), "--num-steps", str(steps), "--warmstart-steps", "0"),
        *("--rollout-batch-size", "4", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "16", "--eval-interval", "0", "--colocate"),
        *extra,
    ]


def _median(events: list[dict], name: str, key: str = "seconds") -> float:
    values = [e[key] for e in events if e["event"] == name and e["step"] > 0]
    return round(statistics.median(values), 4) if values else float("nan")


def summarize(events: list[dict]) -> dict[str, float]:
    """Medians over the train steps' turns (the start-up offload and the final save left out
    of the seconds; every offload after a step counted for the memory)."""
    turns = [e for e in events if e["event"] in ("engines_released", "engines_resumed")]
    steps = {e["step"] for e in turns}
    offloads = [e for e in events if e["event"] == "trainer_offloaded" and e["step"] in steps]
    offloads = [e for e in offloads if e["step"] > 0]
    released = [
        x["weights_bytes"]
        for e in events
        if e["event"] == "engines_released"
        for x in e["engines"]
        if x and x.get("weights_bytes")
    ]
    engine_freed = [
        before - x["rss"]
        for e in events
        if e["event"] == "engines_released"
        for before, x in zip(e.get("rss_before") or [], e["engines"], strict=False)
        if before and x and x.get("rss")
    ]
    return {
        "steps": len(steps),
        "engine_release_s": _median(events, "engines_released"),
        "engine_resume_s": _median(events, "engines_resumed"),
        "trainer_onload_s": _median(events, "trainer_onloaded"),
        "trainer_offload_s": _median(events, "trainer_offloaded"),
        "trainer_offload_bytes": statistics.median(e["bytes"] for e in offloads),
        "trainer_rss_freed_bytes": statistics.median(e["rss_freed"] for e in offloads),
        "trainer_rss_before_bytes": statistics.median(e["rss_before"] for e in offloads),
        "engine_weights_released_bytes": statistics.median(released) if released else 0.0,
        "engine_rss_freed_bytes": statistics.median(engine_freed) if engine_freed else 0.0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_colocate")
    p.add_argument("extra", nargs="*", help="flags passed to the run (after --)")
    a = p.parse_args()
    shutil.rmtree(a.out, ignore_errors=True)
    run_dir = a.out / "run"
    asyncio.run(train(parse_config(_argv(run_dir, a.steps, a.extra))))
    summary = summarize(read_events(run_dir))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
