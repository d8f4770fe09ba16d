"""The prompt ledger, `<run-dir>/trained.jsonl`: which prompt groups each train step trained on.

Owns `ledger_path`, `record_trained` (one JSON line per step, appended), and what a start does
to a ledger already there: a resume forgets the steps after its checkpoint (`truncate_ledger`;
they were rolled back and are redone), a fresh run moves an earlier run's ledger aside
(`archive_stale_ledger`), never appending to it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def ledger_path(run_dir: Path) -> Path:
    """`run_dir/trained.jsonl`."""
    return run_dir / "trained.jsonl"


def record_trained(path: Path, step: int, batch: Any) -> None:
    """Append which prompt groups step `step` trained on."""
    row = {
        "step": step,
        "version": batch.current_version,
        "groups": [[g.prompt.key, g.seq, g.min_version] for g in batch.groups],
        "dropped": batch.dropped,
        "filtered": batch.filtered,
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def truncate_ledger(path: Path, *, keep_through: int) -> None:
    """On resume, forget steps after the checkpoint: they were rolled back and are redone."""
    if not path.exists():
        return
    rows = [x for x in path.read_text().splitlines() if x.strip()]
    kept = [x for x in rows if _ledger_step(x) <= keep_through]
    if len(kept) != len(rows):
        log.info(
            "resume: %d trained-step records after step %d rolled back",
            len(rows) - len(kept),
            keep_through,
        )
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)


def archive_stale_ledger(path: Path) -> Path | None:
    """A fresh run (no --load) starts a new ledger: one left by an earlier run in the same
    directory (e.g. killed before its first checkpoint) is moved aside, never appended to, and
    the move is logged with the way to resume instead. Returns the archive path, if any."""
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    dest = path.with_name(f"{path.name}.stale-{stamp}")
    n = 0
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.stale-{stamp}-{n}")
    os.replace(path, dest)
    log.warning(
        "%s holds the prompt ledger of an earlier run in this --run-dir; this run starts fresh "
        "(no --load), so it starts a new ledger and the old one was moved to %s. To continue "
        "the earlier run instead, stop and pass --load <its --save directory>.",
        path,
        dest,
    )
    return dest


def _ledger_step(line: str) -> float:
    """Step of a ledger line; a line torn by a kill mid-write counts as after any checkpoint."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")
