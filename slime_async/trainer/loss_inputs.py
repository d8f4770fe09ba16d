"""What the trainer computes for the selected loss, and how a micro-batch becomes `LossInputs`.

Owns: `check_loss_needs` (refuse or warn at start-up), `InputPlan` / `plan_inputs` (which
no-grad forwards a train step runs, from the loss's `LossNeeds` and the trainer's settings), `StepInputs` (their results per micro-batch) and
`loss_inputs` (a token-aligned micro-batch → the loss's shifted `[b, w − 1]` tensors). Pure
functions; must never import the controller, engine, rollout or data-worker parts of
`slime_async`, nor `trainer.py`.

Worked example: `--loss ppo --keep-old-actor` with R3 replay → `plan_inputs(ppo.needs, None,
r2=False, keep_old_actor=True)` = InputPlan(proximal=False, behavior=False): no no-grad forward
at all (π_k is the training forward's detached log-probs: one optimizer update per step) and
no snapshot forward (the snapshots are still kept for other callers). CompIS with `denom=keep`
→ InputPlan(proximal=False, behavior=True): only the snapshot forwards of older versions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from loss import LossInputs, LossNeeds, LossSpec
from slime_async.contracts.batch import TrainerBatch


def check_loss_needs(
    spec: LossSpec, *, moe: bool, routing_replay: bool, keep_old_actor: bool
) -> str | None:
    """Refuse a loss the trainer's settings cannot serve (ValueError with the fix); return a
    warning for settings the loss makes useless, else None."""
    if spec.needs.routing_replay and moe and not routing_replay:
        raise ValueError(
            f"loss {spec.name!r} is only valid with MoE routing replay; set --routing-replay r3 "
            "(engine routing) or r2 (trainer routing)"
        )
    if keep_old_actor and not spec.needs.behavior_logprobs:
        return (
            f"keep_old_actor keeps version snapshots, but loss {spec.name!r} does not read "
            "pi_j^Meg: the train step runs no snapshot forward (the snapshots only cost memory; "
            "turn them off with --no-keep-old-actor unless you call compute_logprobs(version=j) "
            "yourself)"
        )
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class InputPlan:
    """The no-grad forwards of one train step."""

    proximal: bool
    """Run a separate π_k forward before the training forward: only when something must be
    known before it (R2 records the routing the training forwards replay; the loss's
    denominators read log-probs under its config). Otherwise π_k is the training forward's
    detached log-probs: a step takes one optimizer update, so they are the same weights."""
    behavior: bool
    """Run the π_j^Meg snapshot forwards (the loss reads them and snapshots are kept); tokens
    of the current version take π_k (from whichever of the two forwards gives it)."""


def plan_inputs(needs: LossNeeds, loss_cfg: Any, *, r2: bool, keep_old_actor: bool) -> InputPlan:
    """Which no-grad forwards to run: only those the loss's `needs` (under `loss_cfg`) make
    necessary (see `InputPlan`)."""
    behavior = needs.behavior_logprobs and keep_old_actor
    proximal = r2 or (needs.proximal_logprobs and needs.denominators_need_logprobs(loss_cfg))
    return InputPlan(proximal=proximal, behavior=behavior)


@dataclasses.dataclass(slots=True)
class StepInputs:
    """No-grad inputs of one train step, per local micro-batch (None: not computed)."""

    proximal: list[torch.Tensor] | None = None
    """π_k `[b, w]` from the no-grad forward (None: the training forward's, detached)."""
    entropy: list[torch.Tensor] | None = None
    """Entropies `[b, w]` from the same forward."""
    behavior: list[torch.Tensor] | None = None
    """π_j^Meg `[b, w]` (None also when a needed version is not held: the loss falls back).
    Without the π_k forward, tokens of the current version hold 0 here and take the training
    forward's detached log-probs (`behavior_with_current`)."""
    reference: list[torch.Tensor] | None = None
    """π_ref `[b, w]` under the reference weights (only for a loss that reads them)."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """Which forwards ran and their timings (`train/*_forwards`, `timing/*_s`)."""

    def behavior_of(self, i: int) -> torch.Tensor | None:
        return None if self.behavior is None else self.behavior[i]

    def behavior_with_current(
        self, i: int, lp_k: torch.Tensor, token_versions: torch.Tensor, version: int
    ) -> torch.Tensor | None:
        """π_j^Meg of micro-batch i with the current version's tokens taking `lp_k` (π_k)."""
        lp_j = self.behavior_of(i)
        if lp_j is None or self.proximal is not None:
            return lp_j
        cur = token_versions.to(lp_k.device) == version
        return torch.where(cur, lp_k, lp_j.to(lp_k.device))

    def reference_of(self, i: int) -> torch.Tensor | None:
        return None if self.reference is None else self.reference[i]


def loss_inputs(
    mb: TrainerBatch,
    logprobs: torch.Tensor,
    proximal: torch.Tensor,
    behavior: torch.Tensor | None,
    *,
    version: int,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    entropy: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
) -> LossInputs:
    """The loss's view of micro-batch `mb`: position t scores token t, so the first column
    (no predecessor) is cut; tensors move to the device of `logprobs` (the forward's)."""
    dev = logprobs.device

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[:, 1:].to(dev)

    return LossInputs(
        logprobs=logprobs[:, 1:],
        proximal_logprobs=cut(proximal),
        rollout_logprobs=cut(mb.rollout_logprobs),
        behavior_logprobs=None if behavior is None else cut(behavior),
        advantages=cut(mb.advantages),
        loss_mask=cut(mb.loss_mask),
        token_versions=cut(mb.token_versions),
        current_version=version,
        global_num_tokens=num_tokens,
        global_num_seqs=num_seqs,
        entropy=None if entropy is None else entropy[:, 1:],
        reference_logprobs=None if reference is None else cut(reference),
    )
