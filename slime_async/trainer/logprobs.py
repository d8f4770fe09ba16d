"""The no-grad log-prob forwards of a trainer rank: π_k, π_j^Meg (version snapshots) and
the routing they replay, and the inputs a train step computes for its loss.

Owns: `LogprobForwards`, the part of `MegatronTrainer` that runs them (`compute_logprobs`,
`compute_behavior_logprobs`, the DP shard / micro-batching, R2/R3 routing, and `_step_inputs`:
only the forwards the selected loss declares, see `loss_inputs.plan_inputs`). Must never import
the controller, engine, rollout or data-worker parts of `slime_async`, nor `trainer.py`.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loss import LossSpec
from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.model import ModelSpec
from slime_async.trainer import parallel
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.forward import padded_width, token_logprobs
from slime_async.trainer.loss_inputs import Routing, StepInputs, plan_inputs
from slime_async.trainer.pipeline import StageExecutor
from slime_async.trainer.replay import RoutingReplay, engine_routing_to_replay
from slime_async.trainer.snapshots import SnapshotStore


class LogprobForwards:
    """Mixin of `MegatronTrainer`: micro-batched no-grad forwards (see the module docstring)."""

    cfg: TrainerConfig
    spec: ModelSpec
    layout: parallel.ParallelLayout
    model: torch.nn.Module
    stage: StageExecutor
    snapshots: SnapshotStore
    loss_spec: LossSpec
    version: int

    # ------------------------------------------------------------------ topology
    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def tp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank()

    def _local(self, batch: TrainerBatch) -> list[TrainerBatch]:
        """This DP rank's micro-batches, each trimmed to its longest sample (the width agreed
        over the DP group, so expert-parallel token exchange sees equal shapes)."""
        local = batch.dp_shard(self.dp_rank, self.layout.dp)
        mbs = local.micro_batches(self.cfg.micro_batch_size)
        widths = torch.tensor([int(mb.lengths.max()) for mb in mbs], dtype=torch.long)
        parallel.all_reduce_sum(widths, parallel.groups()["dp"], op=dist.ReduceOp.MAX)
        return [mb.trimmed(int(w)) for mb, w in zip(mbs, widths)]

    def _gather_dp(self, local: list[torch.Tensor], width: int) -> torch.Tensor:
        """Pad per-micro-batch `[b, w]` results to `width`, concatenate, gather over DP."""
        full = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in local])
        return parallel.all_gather_cat(full, parallel.groups()["dp"])

    # ------------------------------------------------------------------ forwards
    def _engine_routing(self, mb: TrainerBatch) -> Routing:
        if self.cfg.routing_replay is not RoutingReplay.R3 or not self.spec.is_moe:
            return None
        if mb.routed_experts is None:
            raise ValueError(
                "routing_replay='r3' needs batch.routed_experts (request return_routed_experts "
                "from the engines, or set routing_replay to 'none' or 'r2')"
            )
        return engine_routing_to_replay(
            mb.routed_experts,
            spec=self.spec,
            width=padded_width(mb.width, self.layout.tp),
            tp=self.layout.tp,
            tp_rank=self.tp_rank,
            layers=self._local_moe_layers(),
        )

    def _local_moe_layers(self) -> list[int]:
        """Global indices of this pipeline stage's MoE layers (replay data order)."""
        from megatron.core import parallel_state as ps

        n = self.spec.num_layers // self.layout.pp
        lo = ps.get_pipeline_model_parallel_rank() * n
        return [i for i in self.spec.moe_layers() if lo <= i < lo + n]

    @torch.no_grad()
    def _logprobs_local(
        self, mbs: list[TrainerBatch], routing: list[Routing], *, record: list[Routing] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        lps, ents = [], []
        for i, mb in enumerate(mbs):

            def head(logits: torch.Tensor, mb: TrainerBatch = mb) -> torch.Tensor:
                lp, ent = token_logprobs(logits, mb.tokens, temperature=self.cfg.temperature)
                out = torch.stack([lp, ent]).cpu()
                real = torch.arange(mb.width) < mb.lengths.unsqueeze(1)  # padding → 0
                return torch.where(real, out, 0.0)

            out = self.stage.run(mb.tokens, routing[i], head=head, grad=False, record=record)
            if out is None:
                out = torch.zeros(2, *mb.tokens.shape)
            out = self.stage.broadcast_from_last(out)
            lps.append(out[0])
            ents.append(out[1])
        return lps, ents

    def compute_logprobs(
        self, batch: TrainerBatch, version: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-aligned `[B, T]` log-probs and entropies under the current weights (π_k) or a
        kept snapshot of `version` (π_j^Meg). R3 replays `batch.routed_experts` when enabled."""
        self.model.eval()
        mbs = self._local(batch)
        routing = [self._engine_routing(mb) for mb in mbs]
        ctx = (
            contextlib.nullcontext()
            if version is None or version == self.version
            else self.snapshots.swapped_in(self.model, version)
        )
        with ctx:
            lps, ents = self._logprobs_local(mbs, routing, record=None)
        return self._gather_dp(lps, batch.width), self._gather_dp(ents, batch.width)

    def compute_behavior_logprobs(self, batch: TrainerBatch) -> torch.Tensor | None:
        """π_j^Meg `[B, T]`: each token's log-prob under the snapshot of its own version
        (`batch.token_versions`), or None when a needed version is not kept."""
        self.model.eval()
        mbs = self._local(batch)
        routing = [self._engine_routing(mb) for mb in mbs]
        lp_k, _ = self._logprobs_local(mbs, routing, record=None)
        out, _ = self._behavior_logprobs(mbs, lp_k, routing)
        return None if out is None else self._gather_dp(out, batch.width)

    def _behavior_logprobs(
        self, mbs: list[TrainerBatch], lp_k: list[torch.Tensor], routing: list[Routing]
    ) -> tuple[list[torch.Tensor] | None, int]:
        """(π_j^Meg per token, each token from its own version's snapshot, or None if any
        needed version is not held (→ CompIS combined-ratio fallback); micro-batch passes)."""
        if not self.cfg.keep_old_actor:
            return None, 0
        needed = {int(v) for mb in mbs for v in mb.token_versions[mb.loss_mask].unique()}
        # every DP rank must run the same snapshot forwards (collectives inside them)
        needed = parallel.union_ints(needed, parallel.groups()["dp"])
        if any(v != self.version and v not in self.snapshots for v in needed):
            return None, 0
        out, passes = [lp.clone() for lp in lp_k], 0
        for v in sorted(needed - {self.version}):
            # forward only the micro-batches that hold a trained token of version v; the
            # choice is agreed over DP, since TP/EP collectives need every rank in each pass
            has = torch.tensor([int(bool((mb.token_versions[mb.loss_mask] == v).any()))
                                for mb in mbs], dtype=torch.long)  # fmt: skip
            parallel.all_reduce_sum(has, parallel.groups()["dp"])
            idx = [i for i in range(len(mbs)) if int(has[i]) > 0]
            with self.snapshots.swapped_in(self.model, v):
                lps, _ = self._logprobs_local(
                    [mbs[i] for i in idx], [routing[i] for i in idx], record=None
                )
            passes += len(idx)
            for lp_v, i in zip(lps, idx, strict=True):
                out[i] = torch.where(mbs[i].token_versions == v, lp_v, out[i])
        return out, passes

    def _step_inputs(self, mbs: list[TrainerBatch]) -> StepInputs:
        """The no-grad forwards the loss needs: π_k (which also records R2 routing) and π_j^Meg."""
        self.model.eval()
        r2 = self.cfg.routing_replay is RoutingReplay.R2 and self.spec.is_moe
        plan = plan_inputs(self.loss_spec.needs, r2=r2, keep_old_actor=self.cfg.keep_old_actor)
        out = StepInputs(routing=[self._engine_routing(mb) for mb in mbs])
        if plan.proximal:
            t = time.perf_counter()
            recorded: list[Routing] | None = [] if r2 else None
            out.proximal, out.entropy = self._logprobs_local(mbs, out.routing, record=recorded)
            if recorded is not None:
                out.routing = recorded
            out.metrics["timing/proximal_logprobs_s"] = time.perf_counter() - t
        out.metrics["train/proximal_forwards"] = float(len(mbs) if plan.proximal else 0)
        if self.loss_spec.needs.reference_logprobs:  # KL penalty: π_ref under reference weights
            t = time.perf_counter()
            out.reference = self.reference.logprobs(
                self.model, lambda: self._logprobs_local(mbs, out.routing, record=None)[0]
            )
            out.metrics["timing/reference_logprobs_s"] = time.perf_counter() - t
        if plan.behavior:
            assert out.proximal is not None
            t = time.perf_counter()
            out.behavior, passes = self._behavior_logprobs(mbs, out.proximal, out.routing)
            out.metrics["timing/behavior_logprobs_s"] = time.perf_counter() - t
            out.metrics["train/behavior_forwards"] = float(passes)
        return out
