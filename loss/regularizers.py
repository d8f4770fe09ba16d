"""Terms added to any loss: an entropy bonus and a KL penalty to a reference policy (slime's
`--entropy-coef`, `--use-kl-loss --kl-loss-coef --kl-loss-type`; verl's `entropy_coeff`,
`use_kl_loss`).

Owns: `RegularizerConfig` and `with_regularizers(spec, reg) -> LossSpec`, which wraps a loss so
that it also declares the inputs the terms read (`LossNeeds.entropy`,
`LossNeeds.reference_logprobs`). Must never import `slime_async`.

    loss = L_policy − entropy_coef · AGG(H) + kl_coef · AGG(KL(π_θ ‖ π_ref))

AGG is the wrapped loss's own aggregation (its `agg_mode`, `loss_scale_factor` and the global
denominators on `LossInputs`; token-mean for a config without `agg_mode`), so each micro-batch's
term is its share of the mini-batch term, like the policy loss. KL per token is
`loss.kl.kl_penalty` (k1, k2, k3, low_var_kl), times π_θ/π_old with `unbiased_kl`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from loss.aggregate import aggregate
from loss.kl import KLType, kl_penalty
from loss.ratios import safe_log_ratio
from loss.spec import LossSpec
from loss.types import AggMode, LossInputs, LossOutputs


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RegularizerConfig:
    """Entropy bonus and KL penalty added to the selected loss."""

    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (0: no reference model is kept)."""
    kl_type: KLType = KLType.K1
    """Per-token KL estimator (slime's default k1; verl's low_var_kl)."""
    unbiased_kl: bool = False
    """slime's `--use-unbiased-kl`: each token's KL estimate times its importance ratio
    π_θ/π_old (π_old: the loss's `proximal_logprobs`), with gradient through π_θ."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kl_type", KLType(self.kl_type))
        for name in ("entropy_coef", "kl_coef"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or v != v or abs(v) == float("inf"):
                raise ValueError(f"{name}={v!r} must be a finite number.")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef} must be >= 0 (a penalty).")

    @property
    def active(self) -> bool:
        """Whether any term is on."""
        return self.entropy_coef != 0.0 or self.kl_coef != 0.0


def _agg(x: torch.Tensor, inputs: LossInputs, cfg: Any) -> torch.Tensor:
    return aggregate(
        x,
        inputs.loss_mask,
        getattr(cfg, "agg_mode", AggMode.TOKEN_MEAN),
        cu_seqlens=inputs.cu_seqlens,
        loss_scale_factor=getattr(cfg, "loss_scale_factor", None),
        global_num_tokens=inputs.global_num_tokens,
        global_num_seqs=inputs.global_num_seqs,
    )


def with_regularizers(spec: LossSpec, reg: RegularizerConfig | None) -> LossSpec:
    """`spec` plus the entropy and KL terms of `reg` (unchanged when none is on). Metrics gain
    `loss/policy` (the wrapped loss), `loss/entropy` and `loss/kl_ref` (the aggregated terms)."""
    if reg is None or not reg.active:
        return spec
    base = spec.fn

    def fn(inputs: LossInputs, cfg: Any) -> LossOutputs:
        out = base(inputs, cfg)
        loss, metrics = out.loss, {**out.metrics, "loss/policy": float(out.loss.detach())}
        if reg.entropy_coef != 0.0:
            if inputs.entropy is None:
                raise ValueError("entropy_coef != 0 needs LossInputs.entropy (LossNeeds.entropy)")
            h = _agg(inputs.entropy, inputs, cfg)
            loss = loss - reg.entropy_coef * h
            metrics["loss/entropy"] = float(h.detach())
        if reg.kl_coef != 0.0:
            if inputs.reference_logprobs is None:
                raise ValueError(
                    "kl_coef != 0 needs LossInputs.reference_logprobs (LossNeeds.reference_logprobs)"
                )
            ratio = None
            if reg.unbiased_kl:  # π_θ / π_old with gradient, slime's order: exp(log_ratio)
                ratio = torch.exp(safe_log_ratio(inputs.logprobs, inputs.proximal_logprobs))
            per_token = kl_penalty(
                inputs.logprobs, inputs.reference_logprobs, reg.kl_type, importance_ratio=ratio
            )
            kl = _agg(per_token, inputs, cfg)
            loss = loss + reg.kl_coef * kl
            metrics["loss/kl_ref"] = float(kl.detach())
        return LossOutputs(loss=loss, metrics=metrics)

    fn.__name__ = fn.__qualname__ = f"{getattr(base, '__name__', 'loss')}_regularized"
    needs = dataclasses.replace(
        spec.needs,
        entropy=spec.needs.entropy or reg.entropy_coef != 0.0,
        reference_logprobs=spec.needs.reference_logprobs or reg.kl_coef != 0.0,
    )
    return dataclasses.replace(spec, fn=fn, needs=needs)
