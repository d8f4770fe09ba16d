"""The reference policy of a KL penalty (`LossNeeds.reference_logprobs`; slime's `--use-kl-loss`,
`--ref-load`).

Owns: `ReferencePolicy` — a CPU copy of the reference weights (this rank's shards) and the
no-grad forward under them (`ReferencePolicy.logprobs`), and `maybe_reference`. Must never import the controller, engine,
rollout or data-worker parts of `slime_async`, nor `trainer.py`.

The reference is the run's initial weights (after `--hf-checkpoint`, or the model's init), or the
weights `--ref-load` names: an HF directory or a Megatron torch_dist checkpoint (slime's
`--ref-load`, what its converter writes; `megatron_ckpt`). A resume (`--load`) without `--ref-load` is refused: the
weights at the resume point are not the run's reference (the HF directory the run started
from is: its `--hf-checkpoint`, or `run_dir/warmstart` for the embedded default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slime_async.trainer.snapshots import SnapshotStore

_REF = -1
"""The store key of the reference weights (versions are >= 0)."""


class ReferencePolicy:
    """Reference weights held on CPU; forwards swap them in and restore the current ones."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        ref_load: str | None,
        resumed_from: str | None,
        import_hf: Callable[[str], None],
    ) -> None:
        if ref_load is None and resumed_from is not None:
            raise ValueError(
                f"--use-kl-loss with --load {resumed_from}: the resumed weights are not the "
                "run's reference policy; give --ref-load with the HF directory the run started "
                "from (its --hf-checkpoint, or run_dir/warmstart for the embedded default)"
            )
        self.store = SnapshotStore(1)
        if ref_load is None:
            self.store.snapshot(model, _REF)
            return
        current = SnapshotStore(1)
        current.snapshot(model, 0)
        import_hf(ref_load)  # into the live model, then keep a copy and put the weights back
        self.store.snapshot(model, _REF)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(current.state(0)[n].to(p.device))

    def logprobs(
        self, model: torch.nn.Module, forward: Callable[[], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Run `forward` (the trainer's no-grad per-micro-batch log-prob forward) under the
        reference weights."""
        with self.store.swapped_in(model, _REF):
            return forward()


def maybe_reference(trainer: Any) -> ReferencePolicy | None:
    """The trainer's reference policy when its loss reads π_ref, else None."""
    if not trainer.loss_spec.needs.reference_logprobs:
        return None
    return ReferencePolicy(
        trainer.model,
        ref_load=trainer.cfg.ref_load,
        resumed_from=trainer.cfg.load,
        import_hf=trainer.import_weights_dir,
    )
