"""Data contracts of the loss package: inputs, outputs, configs and the small enums they use.

Owns: `LossInputs`, `LossOutputs`, the config hierarchy `PPOConfig` → `WeightedPPOConfig` →
`CompISConfig`, `Correction`, `Method`, `AggMode`, `Denom`.
Every config validates itself in `__post_init__` and fails with a sentence that names the
problem and the fix. Must never import `slime_async` (the loss package is a leaf).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from clifields import StrEnum

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class Method(StrEnum):
    """Per-source correction f(r; l, u) (docs/loss-spec.md §1)."""

    NONE = "none"
    """w = r (raw, unbounded importance weight)."""
    CAP = "cap"
    """w = r if r <= u else 0 (one-sided mask; AReaL `behav_imp_weight_cap`, MIS-token)."""
    CLIP = "clip"
    """w = min(max(r, l), u) (TIS when l = 0)."""
    ICEPOP = "icepop"
    """w = r if l <= r <= u else 0 (two-sided mask, inclusive bounds)."""


class AggMode(StrEnum):
    """Loss aggregation over tokens and sequences (docs/loss-spec.md §10)."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class Denom(StrEnum):
    """Whether tokens zeroed by a masking correction stay in the loss denominator (docs/loss-spec.md §0.3)."""

    KEEP = "keep"
    """Masked tokens contribute 0 to the numerator but still count (default; AReaL, slime)."""
    DROP = "drop"
    """Masked tokens leave the denominator too (verl rejection sampling, AReaL M2PO)."""


def parse_enum(enum_cls: type[StrEnum], value: object, *, field: str) -> StrEnum:
    """Turn a string (or enum member) into `enum_cls`, or raise a ValueError naming the choices."""
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"{field}={value!r} is not supported; use one of {choices}.") from None


def check_bounds(method: Method, low: float, high: float, *, field: str) -> None:
    """Validate (l, u) for a correction method; raise ValueError with the fix."""
    if method is Method.NONE:
        return
    if not (math.isfinite(high) and high > 0):
        raise ValueError(
            f"{field}_high={high!r} must be a finite number > 0 for method {method.value!r} "
            f"(e.g. 2.0 for TIS, 5.0 for an AReaL-style cap)."
        )
    if not (math.isfinite(low) and low >= 0):
        raise ValueError(
            f"{field}_low={low!r} must be a finite number >= 0 (use 0.0 for no floor)."
        )
    if method in (Method.CLIP, Method.ICEPOP) and not low < high:
        raise ValueError(
            f"{field}: method {method.value!r} needs low < high, got low={low} >= high={high}; "
            f"pass the lower bound explicitly (e.g. low=0.5, high=2.0)."
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Correction:
    """Result of a per-source correction: weight and boolean diagnostics (same shape as r)."""

    weight: torch.Tensor
    """Detached correction weight w = f(r)."""
    masked: torch.Tensor
    """Bool: the correction zeroed this token (cap / icepop)."""
    clipped: torch.Tensor
    """Bool: the correction changed the value without zeroing it (clip)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PPOConfig:
    """The PPO knobs every PPO-style loss shares (docs/loss-spec.md §2, §10): clip on r1 and the reducer.

    The configs of CompIS and of the PPO-style baselines extend this class, so each knob (and
    its validation) is written once.
    """

    eps_clip: float = 0.2
    """PPO ε_low on r1: the ratio is clipped below at 1 - eps_clip."""
    eps_clip_high: float = 0.2
    """PPO ε_high on r1 (DAPO clip-higher uses 0.28)."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 for A < 0 tokens (None = off, as in AReaL and slime)."""
    agg_mode: AggMode | str = AggMode.TOKEN_MEAN
    """How per-token losses are reduced to a scalar (docs/loss-spec.md §10)."""
    loss_scale_factor: float | None = None
    """Constant H for seq-mean-token-sum-norm (e.g. the max response length); required there."""
    diagnostics: bool = True
    """Compute the loss's diagnostics (is/*, policy/*, mismatch/*); off = loss/* only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "agg_mode", parse_enum(AggMode, self.agg_mode, field="agg_mode"))
        if not 0.0 < self.eps_clip < 1.0:
            raise ValueError(f"eps_clip={self.eps_clip} must be in (0, 1) (PPO default 0.2).")
        if not self.eps_clip_high > 0.0:
            raise ValueError(
                f"eps_clip_high={self.eps_clip_high} must be > 0 (0.2, or 0.28 for DAPO)."
            )
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(
                f"dual_clip_c={self.dual_clip_c} must be > 1 (the dual clip constant; verl "
                "uses 3.0) or None to disable it."
            )
        if self.agg_mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM:
            if self.loss_scale_factor is None or not self.loss_scale_factor > 0:
                raise ValueError(
                    "agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor > 0 (a constant H "
                    f"such as the max response length), got {self.loss_scale_factor!r}."
                )
        elif self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            raise ValueError(f"loss_scale_factor={self.loss_scale_factor} must be > 0 or None.")

    def ppo_knobs(self) -> dict[str, Any]:
        """This config's `PPOConfig` fields by name (to build another PPO-style config)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(PPOConfig)}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightedPPOConfig(PPOConfig):
    """PPO times a detached importance weight that may zero tokens (CompIS, single ratio)."""

    denom: Denom | str = Denom.KEEP
    """Whether tokens the weight masks stay in the denominator ("keep", default) or not ("drop")."""

    def __post_init__(self) -> None:
        PPOConfig.__post_init__(self)
        object.__setattr__(self, "denom", parse_enum(Denom, self.denom, field="denom"))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CompISConfig(WeightedPPOConfig):
    """Configuration of the CompIS loss (docs/loss-spec.md §3): per-source corrections + PPO core + reducer."""

    staleness_method: Method | str = Method.CLIP
    """f3, the correction applied to r3 = π_k^Meg / π_j^Meg (staleness)."""
    staleness_low: float = 0.0
    """Lower bound l3 of f3 (clip floor / icepop lower edge)."""
    staleness_high: float = 5.0
    """Upper bound u3 of f3 (AReaL's cap 5.0 is the ecosystem default bound)."""
    engine_method: Method | str = Method.CLIP
    """f2, the correction applied to r2 = π_j^Meg / π_j^SGL (engine mismatch)."""
    engine_low: float = 0.0
    """Lower bound l2 of f2."""
    engine_high: float = 2.0
    """Upper bound u2 of f2 (TIS C = 2.0 is the ecosystem default)."""
    log_ratio_clamp: float = 20.0
    """Log-ratios are clamped to ±this before exp (e^20 ≈ 4.85e8; verl uses 20)."""
    diag_sample_size: int = 16384
    """Diagnostics are exact for batches up to this many positions, else use a systematic
    sample of this many positions (and of whole sequences): a few ms at any batch size."""

    def __post_init__(self) -> None:
        WeightedPPOConfig.__post_init__(self)
        for src in ("staleness", "engine"):
            m = parse_enum(Method, getattr(self, f"{src}_method"), field=f"{src}_method")
            object.__setattr__(self, f"{src}_method", m)
            check_bounds(m, getattr(self, f"{src}_low"), getattr(self, f"{src}_high"), field=src)
        if not (math.isfinite(self.log_ratio_clamp) and self.log_ratio_clamp > 0):
            raise ValueError(
                f"log_ratio_clamp={self.log_ratio_clamp} must be a finite number > 0 (default 20)."
            )
        if self.diag_sample_size < 1000:
            raise ValueError(f"diag_sample_size={self.diag_sample_size} must be >= 1000.")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossInputs:
    """Per-token tensors of one micro-batch, padded `[B, T]` or packed `[N]` with `cu_seqlens`.

    All log-prob tensors have the same shape; only `logprobs` may carry gradient. Low-precision
    (bf16/fp16) inputs are upcast to fp32 before any subtraction.
    """

    logprobs: torch.Tensor
    """log π_θ of the sampled tokens (current forward pass, with grad)."""
    proximal_logprobs: torch.Tensor
    """log π_k^Meg: trainer log-probs under the weights at the start of train step k (no grad)."""
    rollout_logprobs: torch.Tensor
    """log π_j^SGL: behaviour log-probs returned by the rollout engine (version j)."""
    behavior_logprobs: torch.Tensor | None = None
    """log π_j^Meg: trainer log-probs under version-j weights; None → combined-ratio fallback."""
    advantages: torch.Tensor
    """Per-token advantages (constant)."""
    loss_mask: torch.Tensor
    """Bool, True on trained response tokens."""
    cu_seqlens: torch.Tensor | None = None
    """Packed inputs only: int offsets `[B + 1]`, `cu_seqlens[0] = 0`, `cu_seqlens[-1] <= N`."""
    token_versions: torch.Tensor | None = None
    """Optional int policy version j_t that generated each token (diagnostics only)."""
    current_version: int | None = None
    """Optional trainer version k (with `token_versions`: staleness k - j diagnostics)."""
    global_num_tokens: float | None = None
    """Valid-token count of the whole mini-batch (all micro-batches, all DP ranks)."""
    global_num_seqs: float | None = None
    """Valid-sequence count of the whole mini-batch (all micro-batches, all DP ranks)."""
    entropy: torch.Tensor | None = None
    """Per-token entropy of π_θ (with grad), for an entropy bonus (`LossNeeds.entropy`)."""
    reference_logprobs: torch.Tensor | None = None
    """log π_ref of the sampled tokens (no grad), for a KL penalty
    (`LossNeeds.reference_logprobs`)."""

    def __post_init__(self) -> None:
        self._check_tensors()
        if self.cu_seqlens is not None:
            self._check_packing(self.cu_seqlens)
        elif self.logprobs.dim() != 2:
            raise ValueError(
                f"inputs of shape {tuple(self.logprobs.shape)} need to be padded [B, T], or "
                f"packed [N] with cu_seqlens."
            )
        for name in ("global_num_tokens", "global_num_seqs"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}={v} must be > 0 (the whole mini-batch's count) or None.")

    def _check_tensors(self) -> None:
        """Every per-token tensor shaped like `logprobs`; the mask bool; the no-grad inputs
        without grad; `logprobs` floating point."""
        shape = self.logprobs.shape
        named = {
            "entropy": self.entropy,
            "reference_logprobs": self.reference_logprobs,
            "proximal_logprobs": self.proximal_logprobs,
            "rollout_logprobs": self.rollout_logprobs,
            "behavior_logprobs": self.behavior_logprobs,
            "advantages": self.advantages,
            "loss_mask": self.loss_mask,
            "token_versions": self.token_versions,
        }
        for name, t in named.items():
            if t is not None and t.shape != shape:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)} but logprobs has {tuple(shape)}; every "
                    f"per-token tensor must have the same shape ([B, T] padded or [N] packed)."
                )
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(
                f"loss_mask must be a bool tensor, got {self.loss_mask.dtype}; pass mask.bool()."
            )
        for name in (
            "proximal_logprobs",
            "rollout_logprobs",
            "behavior_logprobs",
            "reference_logprobs",
        ):
            t = getattr(self, name)
            if t is not None and t.requires_grad:
                raise ValueError(
                    f"{name} requires grad; it must come from a no_grad forward (or be .detach()ed)."
                )
        if not self.logprobs.is_floating_point():
            raise ValueError(f"logprobs must be floating point, got {self.logprobs.dtype}.")

    def _check_packing(self, cu: torch.Tensor) -> None:
        """Packed inputs: 1-D, `cu` integer offsets from 0 within N, no loss past the end."""
        shape = self.logprobs.shape
        if self.logprobs.dim() != 1:
            raise ValueError(
                "cu_seqlens is given, so inputs must be packed 1-D [N]; got shape "
                f"{tuple(shape)}. Drop cu_seqlens for padded [B, T] inputs."
            )
        if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
            raise ValueError("cu_seqlens must be a 1-D integer tensor [B + 1] starting at 0.")
        if int(cu[0]) != 0 or int(cu[-1]) > shape[0]:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at <= N={shape[0]}, got "
                f"{int(cu[0])}..{int(cu[-1])}."
            )
        end = int(cu[-1])
        if end < shape[0] and bool(self.loss_mask[end:].any()):
            raise ValueError(
                f"loss_mask is True past cu_seqlens[-1]={end} (packing padding); those "
                f"positions belong to no sequence: set loss_mask False there."
            )


@dataclasses.dataclass(frozen=True, slots=True)
class LossOutputs:
    """Scalar loss (with grad) and namespaced float metrics."""

    loss: torch.Tensor
    """Scalar loss; with global denominators, this micro-batch's share of the mini-batch loss."""
    metrics: dict[str, float]
    """Namespaced metrics (`loss/*`, `is/<source>/*`, `policy/*`, `mismatch/*`)."""


def upcast(t: torch.Tensor) -> torch.Tensor:
    """Return `t` in fp32 when it is bf16/fp16 (before any subtraction), else unchanged."""
    return t.float() if t.dtype in _LOW_PRECISION else t


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 if any input is fp64, else fp32."""
    return (
        torch.float64
        if any(t is not None and t.dtype == torch.float64 for t in tensors)
        else torch.float32
    )
