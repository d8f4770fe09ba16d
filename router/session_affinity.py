"""Session affinity: the turns of one conversation go to one engine (the one caching its prefix).

Owns: `SESSION_HEADER` (`X-Session-ID`, the header a client or the training gateway names its
session with), `affine_worker` (rendezvous hashing: each engine scores
`blake2b(session, engine url)`, the highest healthy score wins) and `AffinityStats`.
Rendezvous hashing is consistent hashing: when an engine leaves, only its own sessions move
(to their second-highest score); when one joins, only the sessions it now wins move to it.
Requests without the header are balanced by the policy as before.
Must never import: `slime_async`, aiohttp, or the proxy/health/server modules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from router.workers import Worker

SESSION_HEADER = "X-Session-ID"
MAX_SESSION_ID_BYTES = 256
"""A longer session id is refused (400): a key, not a payload."""


@dataclass(slots=True)
class AffinityStats:
    """Session-routing counters (exported by `/metrics`)."""

    session_requests: int = 0
    """Requests that carried `X-Session-ID`."""
    affine: int = 0
    """Of those, answered by the session's engine on the first try."""


def _score(session: str, url: str) -> int:
    h = hashlib.blake2b(f"{session}\0{url}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def affine_worker(session: str, workers: Sequence[Worker]) -> Worker | None:
    """The engine of `session` among `workers` (None when there are none). Stable for as long
    as that engine is among them, whatever else joins or leaves."""
    if not workers:
        return None
    return max(workers, key=lambda w: _score(session, w.url))


def check_session_id(raw: str | None) -> str | None:
    """The header's session id (None when absent or blank); ValueError when too long."""
    if raw is None or not raw.strip():
        return None
    if len(raw.encode()) > MAX_SESSION_ID_BYTES:
        raise ValueError(
            f"header {SESSION_HEADER} is longer than {MAX_SESSION_ID_BYTES} bytes; send a short "
            "key that names the conversation"
        )
    return raw.strip()
