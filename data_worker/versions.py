"""Per-token policy versions, stored run-length encoded.

Owns `VersionRuns`: the versions that produced each output token of a sample. Versions change
only at weight updates, so a 30k-token response usually holds one run (or two, when the
generation spans an update); storing runs keeps this O(updates) instead of O(tokens).
Imports nothing outside the standard library; never imports `slime_async`.

Example:
    >>> v = VersionRuns.constant(3, 4) + VersionRuns.from_sequence([4, 4])
    >>> list(v), v.min(), v.max(), v.runs
    ([3, 3, 3, 3, 4, 4], 3, 4, ((3, 4), (4, 2)))
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import overload


class VersionRuns(Sequence[int]):
    """Immutable per-token versions as `((version, count), ...)` runs (counts > 0, merged)."""

    __slots__ = ("_len", "_max", "_min", "_runs")

    def __init__(self, runs: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[tuple[int, int]] = []
        for version, count in runs:
            version, count = int(version), int(count)
            if count < 0:
                raise ValueError(f"VersionRuns: run count must be >= 0, got {count}")
            if count == 0:
                continue
            if merged and merged[-1][0] == version:
                merged[-1] = (version, merged[-1][1] + count)
            else:
                merged.append((version, count))
        self._runs = tuple(merged)
        self._len = sum(c for _, c in merged)
        self._min = min((v for v, _ in merged), default=None)
        self._max = max((v for v, _ in merged), default=None)

    @classmethod
    def constant(cls, version: int, count: int) -> VersionRuns:
        """`count` tokens all produced by `version`."""
        return cls(((version, count),))

    @classmethod
    def from_sequence(cls, versions: Iterable[int]) -> VersionRuns:
        """Encode any per-token sequence (returns the input itself if already `VersionRuns`)."""
        if isinstance(versions, VersionRuns):
            return versions
        runs: list[tuple[int, int]] = []
        for v in versions:
            if runs and runs[-1][0] == v:
                runs[-1] = (v, runs[-1][1] + 1)
            else:
                runs.append((int(v), 1))
        return cls(runs)

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The `(version, count)` runs in token order."""
        return self._runs

    def min(self) -> int | None:
        """Oldest version among the tokens (None when there are no tokens)."""
        return self._min

    def max(self) -> int | None:
        """Newest version among the tokens (None when there are no tokens)."""
        return self._max

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for version, count in self._runs:
            for _ in range(count):
                yield version

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("VersionRuns index out of range")
        for version, count in self._runs:
            if index < count:
                return version
            index -= count
        raise AssertionError("unreachable")  # pragma: no cover

    def __add__(self, other: object) -> VersionRuns:
        if isinstance(other, VersionRuns):
            return VersionRuns(self._runs + other._runs)
        if isinstance(other, Sequence):
            return self + VersionRuns.from_sequence(other)
        return NotImplemented

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VersionRuns):
            return self._runs == other._runs
        if isinstance(other, Sequence):
            return len(other) == self._len and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._runs)

    def __repr__(self) -> str:
        return f"VersionRuns({list(self._runs)!r})"

    def to_json(self) -> list[list[int]]:
        """JSON form: `[[version, count], ...]`."""
        return [[v, c] for v, c in self._runs]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[int]]) -> VersionRuns:
        """Inverse of `to_json`."""
        return cls((int(v), int(c)) for v, c in data)
