"""Windowed FIFO drain over group submission order.

Owns `FifoWindow`: which completed groups may be consumed. Groups carry submission sequence
numbers 0, 1, 2, ...; the head is the smallest seq not yet released (consumed, staged, dropped
or filtered). Only completed groups with `seq < head + W` are eligible, and eligible groups are
handed out in completion order. `W = 1` is strict submission order, `W = inf` arrival order.
Never imports `slime_async`.

Example (W = 2): groups 0..3 complete in the order 3, 1, 2, 0.
    >>> w = FifoWindow(window=2)
    >>> for seq in (3, 1, 2, 0):
    ...     w.on_complete(seq)
    >>> w.pop_eligible()          # 1 is inside [0, 2); 3 and 2 are blocked
    1
    >>> w.release(1); w.pop_eligible()   # head is still 0: nothing new
    0
    >>> w.release(0); w.pop_eligible(), w.pop_eligible()  # head -> 2: 3 and 2 in arrival order
    (3, 2)
"""

from __future__ import annotations

import heapq
import math


class FifoWindow:
    """Eligibility bookkeeping for the windowed FIFO drain."""

    __slots__ = ("_ahead", "_blocked", "_completion", "_count", "_eligible", "head", "window")

    def __init__(self, *, window: float, head: int = 0, released: set[int] | None = None) -> None:
        if not (math.isinf(window) or window >= 1):
            raise ValueError(f"window must be >= 1 or math.inf, got {window!r}.")
        self.window = window
        self.head = head
        self._ahead: set[int] = set(released or ())
        self._eligible: list[tuple[int, int]] = []  # (completion order, seq)
        self._blocked: list[int] = []  # completed seqs at or beyond head + W
        self._completion: dict[int, int] = {}
        self._count = 0
        self._advance()

    def on_complete(self, seq: int) -> None:
        """A group finished generating: eligible now if inside the window, else blocked."""
        order = self._count
        self._count += 1
        if seq < self.head + self.window:
            heapq.heappush(self._eligible, (order, seq))
        else:
            self._completion[seq] = order
            heapq.heappush(self._blocked, seq)

    def pop_eligible(self) -> int | None:
        """The earliest-completed eligible seq (removed from the eligible set), or None."""
        if not self._eligible:
            return None
        return heapq.heappop(self._eligible)[1]

    def release(self, seq: int) -> None:
        """`seq` leaves the window (consumed, staged, dropped or filtered): advance the head."""
        if seq == self.head:
            self.head += 1
            self._advance()
        elif seq > self.head:
            self._ahead.add(seq)
        else:
            raise ValueError(f"group {seq} released twice (head is already {self.head}).")

    def _advance(self) -> None:
        ahead = self._ahead
        while self.head in ahead:
            ahead.remove(self.head)
            self.head += 1
        end = self.head + self.window
        blocked = self._blocked
        while blocked and blocked[0] < end:
            s = heapq.heappop(blocked)
            heapq.heappush(self._eligible, (self._completion.pop(s), s))

    @property
    def num_eligible(self) -> int:
        """Completed groups consumable now."""
        return len(self._eligible)

    @property
    def num_blocked(self) -> int:
        """Completed groups waiting for the head to advance."""
        return len(self._blocked)
