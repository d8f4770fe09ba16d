"""Per-prompt response-length cache (EMA).

Owns `LengthCache`: the expected response length of each prompt key, an exponential moving
average over its finished samples. Probe dispatch reads it to order samples longest-first and
passes it to `generate` as the expected length. Never imports `slime_async`.

Example:
    >>> c = LengthCache(alpha=0.5)
    >>> c.update("p", 100); c.update("p", 300); c.get("p")
    200.0
"""

from __future__ import annotations

from collections.abc import Mapping


class LengthCache:
    """EMA of response length per prompt key."""

    __slots__ = ("_alpha", "_ema")

    def __init__(self, *, alpha: float) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}.")
        self._alpha = alpha
        self._ema: dict[str, float] = {}

    def get(self, key: str) -> float | None:
        """Expected length of `key`, or None when never seen."""
        return self._ema.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._ema

    def __len__(self) -> int:
        return len(self._ema)

    def update(self, key: str, length: int) -> float:
        """Fold one finished response length into the EMA; returns the new value."""
        old = self._ema.get(key)
        new = float(length) if old is None else self._alpha * length + (1.0 - self._alpha) * old
        self._ema[key] = new
        return new

    def to_json(self) -> dict[str, float]:
        """JSON form (key -> EMA)."""
        return dict(self._ema)

    def load_json(self, data: Mapping[str, float]) -> None:
        """Replace the cache contents with `data`."""
        self._ema = {str(k): float(v) for k, v in data.items()}
