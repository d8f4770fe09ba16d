"""The no-grad log-prob forwards of a trainer rank: π_k, π_j^Meg (version snapshots) and
the routing they replay, and the inputs a train step computes for its loss.

Owns: `LogprobForwards`, the part of `MegatronTrainer` that runs them (`compute_logprobs`,
`compute_behavior_logprobs`, the DP shard / micro-batch plan (`packing.plan_micro_batches`),
R2/R3 routing, and `_step_inputs`: only the forwards the selected loss declares, see
`loss_inputs.plan_inputs`). Every forward goes through megatron's schedule
(`schedule.Schedule`, `forward_only=True`). Must never import the controller, engine, rollout
or data-worker parts of `slime_async`, nor `trainer.py`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from loss import LossSpec
from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.model import ModelSpec
from slime_async.trainer import packing, parallel
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.forward import position_logprobs
from slime_async.trainer.loss_inputs import StepInputs, plan_inputs
from slime_async.trainer.replay import RoutingReplay, engine_routing_to_replay
from slime_async.trainer.schedule import MicroBatch, Schedule, micro_batch
from slime_async.trainer.snapshots import SnapshotStore

log = logging.getLogger(__name__)


class LogprobForwards:
    """Mixin of `MegatronTrainer`: micro-batched no-grad forwards (see the module docstring)."""

    cfg: TrainerConfig
    spec: ModelSpec
    layout: parallel.ParallelLayout
    model: torch.nn.Module
    schedule: Schedule
    snapshots: SnapshotStore
    loss_spec: LossSpec
    loss_cfg: Any
    version: int
    moe_layers: list[int]
    every_position_through_head: bool = False
    """True: every position goes through the LM head, as before the head computed only what is
    read (the reference the tests compare against); False: only `MicroBatch.read`."""

    def head_reads(self, mb: MicroBatch, tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The positions of `mb` the LM head computes (`position_logprobs`'s `read`): those of
        its trained tokens, or of `tokens` (a token-aligned `[b, w]` mask) when given."""
        if self.every_position_through_head:
            return None
        return mb.read if tokens is None else mb.reads(tokens)

    # ------------------------------------------------------------------ topology
    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def tp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank()

    def _local(self, batch: TrainerBatch) -> list[MicroBatch]:
        """This DP rank's micro-batches (`packing.plan_micro_batches`: the same plan on every
        rank); with EP > 1 every shard's i-th micro-batch gets the same input shape (the
        allgather MoE dispatcher exchanges equally many tokens between EP ranks), with
        virtual pipeline stages every micro-batch does (fixed-shape p2p, `model.py`)."""
        c, lay = self.cfg, self.layout
        lengths = batch.lengths.tolist()
        budget = c.max_tokens_per_gpu if c.use_dynamic_batch_size else None
        if budget is not None and max(lengths) > budget and not getattr(self, "_overrun", False):
            self._overrun = True  # once per trainer
            log.warning(
                "a sample of %d tokens exceeds --max-tokens-per-gpu %d: it gets a micro-batch of "
                "its own (raise the budget to at least the longest prompt + response)",
                max(lengths),
                budget,
            )
        plans = packing.plan_micro_batches(
            lengths,
            dp=lay.dp,
            micro_batch_size=c.micro_batch_size,
            max_tokens=budget,
            multiple_of=lay.pp if c.virtual_pipeline_model_parallel_size else 1,
        )
        packed = c.qkv_format == "thd"
        vp = c.virtual_pipeline_model_parallel_size
        floors = None
        if lay.ep > 1 or lay.etp > lay.tp or vp is not None:  # tp_ep groups span DP
            floors = packing.shape_floor(plans, lengths, packed=packed)
            if vp is not None:
                floors = [tuple(max(f[j] for f in floors) for j in (0, 1))] * len(floors)
        local = batch.dp_shard(self.dp_rank, lay.dp)
        return [
            micro_batch(
                local,
                rows,
                packed=packed,
                tp=lay.tp,
                min_width=floors[i][0] if floors else 0,
                min_rows=floors[i][1] if floors else 0,
            )
            for i, rows in enumerate(plans[self.dp_rank])
        ]

    def _gather(
        self, per_mb: list[torch.Tensor], mbs: list[MicroBatch], n: int, width: int
    ) -> torch.Tensor:
        """Scatter per-micro-batch `[b, w]` results to this shard's rows (`[n, width]`)."""
        out = torch.zeros(n, width)
        for t, mb in zip(per_mb, mbs, strict=True):
            out[mb.rows] = F.pad(t, (0, width - t.shape[1]))
        return out

    def _gather_dp(self, local: torch.Tensor) -> torch.Tensor:
        return parallel.all_gather_cat(local, parallel.groups()["dp"])

    # ------------------------------------------------------------------ forwards
    def _set_engine_routing(self, mbs: list[MicroBatch]) -> None:
        """R3: each micro-batch replays the engine's routing, placed like its tokens."""
        if not self.cfg.routing_replay.replays_engine_routing or not self.spec.is_moe:
            return
        for mb in mbs:
            if mb.batch.routed_experts is None:
                raise ValueError(
                    "routing_replay='r3' needs batch.routed_experts (request "
                    "return_routed_experts from the engines, or set routing_replay to 'none' "
                    "or 'r2')"
                )
            mb.routing = engine_routing_to_replay(
                mb.batch.routed_experts,
                spec=self.spec,
                width=mb.layout.width,
                tp=self.layout.tp,
                tp_rank=self.tp_rank,
                layers=self.moe_layers,
                starts=mb.layout.starts,
                rows=mb.layout.rows,
            )

    def _logprobs_local(
        self,
        mbs: list[MicroBatch],
        *,
        record: bool = False,
        version: int | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """No-grad token-aligned (log-probs, entropies) `[b, w]` per micro-batch, on every
        pipeline stage, of the trained tokens (only those sampled by `version`, when given; 0
        elsewhere). `record` (R2): each micro-batch's routing is kept in `mb.recorded`."""

        def head(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
            b = mb.batch
            tokens = None if version is None else b.loss_mask & (b.token_versions == version)
            lp, ent = position_logprobs(
                logits,
                mb.input_ids,
                temperature=self.cfg.temperature,
                read=self.head_reads(mb, tokens),
            )
            return torch.stack([mb.to_samples(lp), mb.to_samples(ent)]).cpu()

        outs = self.schedule.run(mbs, head, forward_only=True, record=record)
        if self.layout.pp > 1:
            outs = self._from_last_stage(outs, mbs)
        return [o[0] for o in outs], [o[1] for o in outs]

    def _from_last_stage(
        self, outs: list[torch.Tensor], mbs: list[MicroBatch]
    ) -> list[torch.Tensor]:
        """Every pipeline stage gets the last stage's per-micro-batch `[2, b, w]` results."""
        from megatron.core import parallel_state as ps

        sizes = [(mb.batch.size, mb.batch.width) for mb in mbs]
        flat = torch.zeros(sum(2 * b * w for b, w in sizes))
        if outs:
            flat = torch.cat([o.reshape(-1) for o in outs])
        flat = parallel.broadcast(
            flat, src=ps.get_pipeline_model_parallel_last_rank(), group=parallel.groups()["pp"]
        )
        res, at = [], 0
        for b, w in sizes:
            res.append(flat[at : at + 2 * b * w].view(2, b, w))
            at += 2 * b * w
        return res

    def compute_logprobs(
        self, batch: TrainerBatch, version: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-aligned `[B, T]` log-probs and entropies under the current weights (π_k) or a
        kept snapshot of `version` (π_j^Meg), of the trained tokens (`batch.loss_mask`; 0
        elsewhere: only their positions go through the LM head). R3 replays
        `batch.routed_experts` when enabled."""
        mbs = self._local(batch)
        self._set_engine_routing(mbs)
        ctx = (
            contextlib.nullcontext()
            if version is None or version == self.version
            else self.snapshots.swapped_in(self.model, version)
        )
        with ctx:
            lps, ents = self._logprobs_local(mbs)
        n = batch.size // self.layout.dp
        return (
            self._gather_dp(self._gather(lps, mbs, n, batch.width)),
            self._gather_dp(self._gather(ents, mbs, n, batch.width)),
        )

    def compute_behavior_logprobs(self, batch: TrainerBatch) -> torch.Tensor | None:
        """π_j^Meg `[B, T]`: each token's log-prob under the snapshot of its own version
        (`batch.token_versions`), or None when a needed version is not kept."""
        mbs = self._local(batch)
        self._set_engine_routing(mbs)
        lp_k, _ = self._logprobs_local(mbs)
        out, _ = self._behavior_logprobs(mbs, lp_k)
        if out is None:
            return None
        return self._gather_dp(self._gather(out, mbs, batch.size // self.layout.dp, batch.width))

    def _behavior_logprobs(
        self, mbs: list[MicroBatch], lp_k: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor] | None, int]:
        """(π_j^Meg per token, each token from its own version's snapshot, or None if any
        needed version is not held (→ CompIS combined-ratio fallback); micro-batch passes).
        Tokens of the current version take `lp_k`, or 0 when it is None (the train step fills
        them from its training forward: `StepInputs.behavior_with_current`)."""
        if not self.cfg.keep_old_actor:
            return None, 0
        versions = [mb.batch.token_versions[mb.batch.loss_mask] for mb in mbs]
        needed = {int(v) for vs in versions for v in vs.unique()}
        # every DP rank must run the same snapshot forwards (collectives inside them)
        needed = parallel.union_ints(needed, parallel.groups()["dp"])
        if any(v != self.version and v not in self.snapshots for v in needed):
            return None, 0
        if lp_k is None:
            out = [torch.zeros(mb.batch.size, mb.batch.width) for mb in mbs]
        else:
            out = [lp.clone() for lp in lp_k]
        passes = 0
        for v in sorted(needed - {self.version}):
            # forward only the micro-batches that hold a trained token of version v (agreed
            # over DP: TP/EP collectives need every rank in each pass); the interleaved
            # schedule needs a multiple of PP micro-batches, so it runs them all
            has = torch.tensor([int(bool((vs == v).any())) for vs in versions], dtype=torch.long)
            parallel.all_reduce_sum(has, parallel.groups()["dp"])
            interleaved = self.cfg.virtual_pipeline_model_parallel_size is not None
            idx = [i for i in range(len(mbs)) if interleaved or int(has[i]) > 0]
            with self.snapshots.swapped_in(self.model, v):
                lps, _ = self._logprobs_local([mbs[i] for i in idx], version=v)
            passes += len(idx)
            for lp_v, i in zip(lps, idx, strict=True):
                out[i] = torch.where(mbs[i].batch.token_versions == v, lp_v, out[i])
        return out, passes

    def _step_inputs(self, mbs: list[MicroBatch]) -> StepInputs:
        """The no-grad forwards the loss needs: π_k (which also records R2 routing) and π_j^Meg."""
        r2 = self.cfg.routing_replay is RoutingReplay.R2 and self.spec.is_moe
        plan = plan_inputs(
            self.loss_spec.needs, self.loss_cfg, r2=r2, keep_old_actor=self.cfg.keep_old_actor
        )
        self._set_engine_routing(mbs)
        out = StepInputs()
        if plan.proximal:
            t = time.perf_counter()
            out.proximal, out.entropy = self._logprobs_local(mbs, record=r2)
            if r2:
                for mb in mbs:  # the later forwards of this step replay it
                    mb.routing = mb.recorded
            out.metrics["timing/proximal_logprobs_s"] = time.perf_counter() - t
        out.metrics["train/proximal_forwards"] = float(len(mbs) if plan.proximal else 0)
        if self.loss_spec.needs.reference_logprobs:  # KL penalty: π_ref under reference weights
            t = time.perf_counter()
            out.reference = self.reference.logprobs(
                self.model, lambda: self._logprobs_local(mbs)[0]
            )
            out.metrics["timing/reference_logprobs_s"] = time.perf_counter() - t
        if plan.behavior:
            t = time.perf_counter()
            if self.cfg.behavior_forward == "role":
                out.behavior, missing = self._precomputed_behavior(mbs, out.proximal)
                out.metrics["train/behavior_missing_tokens"] = float(missing)
                passes = 0
            else:
                out.behavior, passes = self._behavior_logprobs(mbs, out.proximal)
            out.metrics["timing/behavior_logprobs_s"] = time.perf_counter() - t
            out.metrics["train/behavior_forwards"] = float(passes)
        return out

    def _precomputed_behavior(
        self, mbs: list[MicroBatch], lp_k: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor] | None, int]:
        """π_j^Meg from the batch (`behavior_logprobs`, computed by the forward-only role when
        each sample completed), tokens of the current version taking `lp_k` (or 0, filled from
        the training forward). (None, missing tokens) when any trained token of an older
        version has no value on some DP rank: the loss then falls back to the combined ratio."""
        out, missing = [], 0
        for i, mb in enumerate(mbs):
            b = mb.batch
            old = b.loss_mask & (b.token_versions != self.version)
            given = b.behavior_logprobs
            if given is None:  # e.g. --max-staleness 0: no role, every token is current
                given = torch.full(tuple(b.tokens.shape), float("nan"))
            missing += int((old & ~torch.isfinite(given)).sum())
            cur = torch.zeros_like(given) if lp_k is None else lp_k[i]
            out.append(torch.where(old, given.nan_to_num(0.0), cur))
        count = torch.tensor([missing], dtype=torch.long)
        parallel.all_reduce_sum(count, parallel.groups()["dp"])
        if int(count[0]):
            return None, int(count[0])
        return out, 0
