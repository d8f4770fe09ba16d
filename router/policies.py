"""Load-balancing policies: small classes behind one `Policy` interface.

Owns: `Policy`, `LeastExpectedTokens`, `LeastRequests`, `RoundRobin`, `make_policy`.
Must never import: `slime_async`, aiohttp, or the proxy/server modules. Policies only read the
counters on `Worker`; the dispatcher (router/dispatch.py) updates them (select + increment happen
without an `await` in between, so the choice and the accounting are atomic on the event loop).
With late binding the candidates are only the engines with room, so the policy chooses among
those at the moment a request is bound, not when it arrived.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from router.workers import Worker


class Policy(abc.ABC):
    """Chooses one worker among the healthy candidates for a request."""

    name: str = ""

    @abc.abstractmethod
    def select(self, candidates: Sequence[Worker], *, expected_tokens: int) -> Worker:
        """Return one of `candidates` (non-empty) for a request expected to emit
        `expected_tokens` response tokens."""


class RoundRobin(Policy):
    """Cycle through candidates in registration order, ignoring load.

    Example: candidates [a, b, c] -> a, b, c, a, ...
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Worker], *, expected_tokens: int) -> Worker:
        w = candidates[self._next % len(candidates)]
        self._next += 1
        return w


class LeastRequests(Policy):
    """Fewest outstanding requests; ties broken round-robin.

    Example: outstanding requests a=3, b=1, c=1 -> b, then (b=2, c=1) -> c.
    """

    name = "least_requests"

    def __init__(self) -> None:
        self._tie = 0

    def select(self, candidates: Sequence[Worker], *, expected_tokens: int) -> Worker:
        self._tie += 1
        n = len(candidates)
        best, best_key = candidates[0], None
        for i, w in enumerate(candidates):
            key = (w.outstanding_requests, (i - self._tie) % n)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best


class LeastExpectedTokens(Policy):
    """Fewest outstanding *expected* response tokens (the work still queued on each engine).

    Every in-flight request contributes its `X-Expected-Tokens` hint (or the configured default)
    until it finishes. Choosing the engine with the least outstanding work is greedy list
    scheduling: with requests sent longest-first (as the data worker's probe dispatch does) it
    is LPT, whose makespan is within 4/3 of optimal; round-robin can put several long requests on
    one engine and leave it straggling. Ties: fewer requests, then round-robin.

    Example: outstanding tokens a=8000 (1 request), b=500 (3 requests) -> a 4000-token request
    goes to b (b=4500), the next to b again only if 4500 < 8000.
    """

    name = "least_expected_tokens"

    def __init__(self) -> None:
        self._tie = 0

    def select(self, candidates: Sequence[Worker], *, expected_tokens: int) -> Worker:
        self._tie += 1
        n = len(candidates)
        best = candidates[0]
        best_key = None
        for i, w in enumerate(candidates):
            key = (w.outstanding_tokens, w.outstanding_requests, (i - self._tie) % n)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best


_POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (LeastExpectedTokens, LeastRequests, RoundRobin)
}


def make_policy(name: str) -> Policy:
    """A fresh policy instance by name; raises with the valid names on a typo."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown router policy {name!r}; choose one of {sorted(_POLICIES)}"
        ) from None
