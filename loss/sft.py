"""Supervised fine-tuning as a loss: the negative log-likelihood of the trained tokens.

Owns `SFTConfig` and `sft_loss`, registered as `--loss sft` (slime's `--loss-type sft_loss`) in
`loss.registry`. The trained tokens are the batch's `loss_mask`: the assistant turns of a
conversation (`slime_async.rollout.data.sft`) or the responses of a rollout dump. It reads only
the training forward's log-probs (no π_k, no engine log-probs, no advantages). Must never
import `slime_async`.

Worked example: log-probs [[-1, -2, -3], [-4, 0, 0]], mask [[T, T, T], [T, F, F]]:
token-mean NLL (1 + 2 + 3 + 4) / 4 = 2.5; seq-mean-token-mean (2 + 4) / 2 = 3.0.
"""

from __future__ import annotations

import dataclasses

import torch

from loss.aggregate import aggregate
from loss.types import AggMode, LossInputs, LossOutputs, parse_enum, upcast


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SFTConfig:
    """How the per-token NLL is reduced (`--loss-agg-mode`, slime's
    `--calculate-per-token-loss` = token-mean)."""

    agg_mode: AggMode | str = AggMode.TOKEN_MEAN
    """token-mean: the mean NLL of every trained token of the batch; seq-mean-token-mean:
    slime's per-sample mean (each sequence's mean NLL, averaged)."""
    loss_scale_factor: float | None = None
    """Constant H of seq-mean-token-sum-norm."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "agg_mode", parse_enum(AggMode, self.agg_mode, field="agg_mode"))
        if self.agg_mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM and not (
            self.loss_scale_factor and self.loss_scale_factor > 0
        ):
            raise ValueError(
                "agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor > 0, got "
                f"{self.loss_scale_factor!r}."
            )


def sft_loss(inputs: LossInputs, cfg: SFTConfig | None = None) -> LossOutputs:
    """NLL of the trained tokens, −AGG(log π_θ) over `loss_mask` (`[B, T]` or packed `[N]`);
    with global denominators the micro-batch's share of the batch loss. Metrics: `loss/value`,
    `sft/nll` (this micro-batch's mean NLL per trained token)."""
    cfg = cfg or SFTConfig()
    nll = -upcast(inputs.logprobs)
    mask = inputs.loss_mask
    loss = aggregate(
        nll,
        mask,
        cfg.agg_mode,
        cu_seqlens=inputs.cu_seqlens,
        loss_scale_factor=cfg.loss_scale_factor,
        global_num_tokens=inputs.global_num_tokens,
        global_num_seqs=inputs.global_num_seqs,
    )
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        mean_nll = torch.where(mask, nll.detach(), 0.0).sum() / n
    return LossOutputs(
        loss=loss, metrics={"loss/value": float(loss.detach()), "sft/nll": float(mean_nll)}
    )
