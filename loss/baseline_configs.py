"""Configs of the baseline losses (`loss.baselines`), one frozen dataclass per loss.

Owns: `DecoupledPPOConfig`, `SingleRatioConfig`, `M2POConfig`, `GSPOConfig`,
`PrimeMaskedISConfig` and `config_of` (a config object, or one built from keyword arguments).
The PPO-style ones extend `PPOConfig`/`WeightedPPOConfig` from `loss.types`, so the shared PPO
knobs are written once. Each validates itself and fails with a sentence naming the fix. Must
never import `slime_async`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from loss.types import Method, PPOConfig, WeightedPPOConfig, check_bounds, parse_enum

C = TypeVar("C")


def config_of(cls: type[C], cfg: C | None, kw: dict[str, Any]) -> C:
    """`cfg` itself, or `cls(**kw)` when it is None (a loss called with keyword arguments)."""
    if cfg is None:
        return cls(**kw)
    if kw:
        raise ValueError(
            f"pass either a {cls.__name__} or keyword arguments, not both (got {sorted(kw)})."
        )
    if not isinstance(cfg, cls):
        raise ValueError(f"expected a {cls.__name__}, got {type(cfg).__name__}.")
    return cfg


_ACTIONS = {"mask": Method.CAP, "clamp": Method.CLIP, None: Method.NONE}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DecoupledPPOConfig(PPOConfig):
    """AReaL decoupled PPO (docs/loss-spec.md §4): one behaviour weight π_k/π_j^SGL with a one-sided cap."""

    cap: float = 5.0
    """Bound of the behaviour weight (AReaL default 5.0; must be > 1)."""
    action: str | None = "mask"
    """"mask": weight 0 above `cap` (kept in the denominator); "clamp": min(w, cap) (TIS);
    None: no behaviour weight at all (AReaL 1.0.4 with `rejection_sampling=None`)."""

    def __post_init__(self) -> None:
        PPOConfig.__post_init__(self)
        if not self.cap > 1.0:
            raise ValueError(f"cap={self.cap} must be > 1 (AReaL default 5.0).")
        if self.action not in _ACTIONS:
            raise ValueError(
                f"action={self.action!r} is not supported; use 'mask', 'clamp' or None."
            )

    @property
    def method(self) -> Method:
        """The correction `action` stands for (cap, clip or none)."""
        return _ACTIONS[self.action]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SingleRatioConfig(WeightedPPOConfig):
    """One IS weight on the combined ratio ρ = π_k/π_j^SGL (decoupled mode), docs/loss-spec.md §5."""

    level: str = "token"
    """"token" (w_t = f(ρ_t)) or "sequence" (w = f(∏_t ρ_t) on every token of the sequence)."""
    method: Method | str = Method.CLIP
    """clip = TIS (low 0), cap = MIS, icepop = two-sided mask, none = raw weight."""
    low: float = 0.0
    """Lower bound l of the correction."""
    high: float = 2.0
    """Upper bound u (TIS C = 2)."""
    veto_threshold: float | None = None
    """Drop whole sequences with any ρ_t below this (slime 1e-4); None = off."""
    geo_low: float | None = None
    """Geo-RS: drop sequences whose geometric-mean ratio is below this (None = off)."""
    geo_high: float | None = None
    """Geo-RS: drop sequences whose geometric-mean ratio is above this (None = off)."""
    batch_normalize: bool = False
    """Divide weights by their batch mean after truncation (verl `rollout_is_batch_normalize`)."""

    def __post_init__(self) -> None:
        WeightedPPOConfig.__post_init__(self)
        object.__setattr__(self, "method", parse_enum(Method, self.method, field="method"))
        if self.level not in ("token", "sequence"):
            raise ValueError(f"level={self.level!r} is not supported; use 'token' or 'sequence'.")
        check_bounds(self.method, self.low, self.high, field="single_ratio")
        if (self.geo_low is None) != (self.geo_high is None):
            raise ValueError("give both geo_low and geo_high (e.g. 0.999 and 1.001) or neither.")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class M2POConfig(PPOConfig):
    """M2PO (docs/loss-spec.md §6, paper/AReaL masking form): second-moment token mask, then decoupled PPO."""

    tau: float = 0.04
    """Budget τ: remove the fewest top-(log ρ)² tokens until their mean is below τ (paper 0.04)."""
    cap: float | None = None
    """Optional cap on the behaviour weight π_k/π_j^SGL of the kept tokens (None = raw weight)."""

    def __post_init__(self) -> None:
        PPOConfig.__post_init__(self)
        if not self.tau > 0:
            raise ValueError(f"tau={self.tau} must be > 0 (M2PO uses 0.04).")
        if self.cap is not None and not self.cap > 0:
            raise ValueError(f"cap={self.cap} must be > 0 or None.")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GSPOConfig:
    """GSPO (docs/loss-spec.md §7): sequence-level geometric-mean ratio, seq-mean-token-mean."""

    eps_low: float = 3e-4
    """Clip below at 1 − eps_low on the sequence ratio (paper 3e-4)."""
    eps_high: float = 4e-4
    """Clip above at 1 + eps_high on the sequence ratio (paper 4e-4)."""
    log_ratio_max: float = 10.0
    """Clamp on log s_i,t after the stop-gradient combination, as verl (10): a sequence whose
    mean log-ratio reaches it gets no gradient."""

    def __post_init__(self) -> None:
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(
                f"GSPO needs 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, "
                f"{self.eps_high} (paper: 3e-4, 4e-4)."
            )
        if not self.log_ratio_max > 0:
            raise ValueError(f"log_ratio_max={self.log_ratio_max} must be > 0 (verl: 10).")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrimeMaskedISConfig:
    """prime-rl (pre-IPO) masked IS (docs/loss-spec.md §12): token, geometric-mean and sequence masks."""

    token_low: float = 0.125
    """Mask tokens with ρ_t below this."""
    token_high: float = 8.0
    """Mask tokens with ρ_t above this."""
    geo_low: float = 0.1
    """Mask sequences whose geometric-mean ratio is below this."""
    geo_high: float = 10.0
    """Mask sequences whose geometric-mean ratio is above this."""
    seq_low: float = 0.0
    """Mask sequences with any ρ_t below this."""
    seq_high: float = 100.0
    """Mask sequences with any ρ_t above this."""
    kl_tau: float = 0.0
    """KL coefficient: the token weight is ρ·(A − kl_tau·log ρ)."""

    def __post_init__(self) -> None:
        for name in ("token", "geo", "seq"):
            lo, hi = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if not 0 <= lo < hi:
                raise ValueError(f"{name}_low must be >= 0 and < {name}_high, got {lo} and {hi}.")
