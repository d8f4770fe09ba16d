"""Checkpoint state of the scheduling core (JSON only, never pickle).

Owns `core_state_dict` / `core_load_state_dict`. The state holds the source cursor, the next
sequence number, the served version, the counters, the length cache and every unresolved group
(queued, in flight, complete or staged) as a prompt to re-issue with its original sequence
number. The window head and the set of groups already released beyond it are derived from
those, so a resumed worker regenerates exactly the pending groups: no prompt is lost and none
is produced twice. Never imports `slime_async`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from data_worker.records import GroupRecord
from data_worker.scheduler import SchedulerCore
from data_worker.types import Prompt
from data_worker.window import FifoWindow

FORMAT = "slime-async/data-worker/v1"

_COUNTERS = (
    "n_admitted",
    "n_consumed",
    "n_dropped",
    "n_filtered",
    "n_dispatches",
    "n_aborted",
    "n_errors",
    "n_probes",
    "n_cache_hits",
)
_LENGTH_COUNTERS = ("consumed_tokens", "consumed_samples", "dropped_tokens", "dropped_samples")
"""Saved too; a state written before they existed loads them as 0."""


def core_state_dict(core: SchedulerCore) -> dict[str, Any]:
    """JSON-serialisable snapshot; in-flight work is saved as prompts to re-issue."""
    pending = [core.groups[s] for s in sorted(core.groups)]
    state = {
        "format": FORMAT,
        "source": core.source.state_dict(),
        "next_seq": core.next_seq,
        "served_version": core.served_version,
        "exhausted": core.exhausted,
        "counters": {name: getattr(core, name) for name in _COUNTERS + _LENGTH_COUNTERS},
        "length_cache": core.cache.to_json(),
        "pending": [
            {"seq": r.seq, "admitted_version": r.admitted_version, "prompt": r.prompt.to_json()}
            for r in pending
        ],
    }
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"data worker state is not JSON-serialisable ({exc}); prompt payloads and the "
            "source cursor must hold only JSON types (str, int, float, bool, None, list, dict)."
        ) from None
    return state


def core_load_state_dict(core: SchedulerCore, state: Mapping[str, Any]) -> None:
    """Restore a fresh core from `core_state_dict` output; pending groups are re-queued."""
    if core.n_admitted or core.groups:
        raise RuntimeError(
            "load_state_dict needs a fresh worker: call it right after construction, "
            "before start()."
        )
    if state.get("format") != FORMAT:
        raise ValueError(
            f"not a data-worker state (format {state.get('format')!r}, expected {FORMAT!r})."
        )
    core.source.load_state_dict(state["source"])
    core.next_seq = int(state["next_seq"])
    core.served_version = int(state["served_version"])
    core.exhausted = bool(state["exhausted"])
    for name in _COUNTERS:
        setattr(core, name, int(state["counters"][name]))
    for name in _LENGTH_COUNTERS:
        setattr(core, name, int(state["counters"].get(name, 0)))
    core.cache.load_json(state["length_cache"])
    entries = sorted(state["pending"], key=lambda e: int(e["seq"]))
    seqs = [int(e["seq"]) for e in entries]
    if len(set(seqs)) != len(seqs) or any(not 0 <= s < core.next_seq for s in seqs):
        raise ValueError("corrupt data-worker state: pending sequence numbers are invalid.")
    head = seqs[0] if seqs else core.next_seq
    released = set(range(head, core.next_seq)).difference(seqs)
    core.window = FifoWindow(window=core.cfg.fifo_window, head=head, released=released)
    n = core.cfg.n_samples_per_prompt
    for entry, seq in zip(entries, seqs):
        rec = GroupRecord(seq, Prompt.from_json(entry["prompt"]), n, int(entry["admitted_version"]))
        core.groups[seq] = rec
        core._schedule_new(rec)
