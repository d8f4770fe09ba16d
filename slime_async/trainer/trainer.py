"""`MegatronTrainer`: the Ray-free trainer core (one instance per trainer rank).

Owns: the model and optimizer of this rank, micro-batched log-prob forwards (π_k, π_j^Meg via
snapshots), the CompIS train step with global denominators, routing replay, the version
counter, weight export and checkpoint hooks. Must never import the controller, engine,
rollout or data-worker parts of `slime_async` (the Ray wrapper lives in `actor.py`).

Every rank of a trainer group receives the same *global* `TrainerBatch`; each data-parallel
rank works on its contiguous shard and results are gathered back, so callers never slice.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loss import LossInputs, compis_denominators
from loss.registry import resolve_loss
from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weights import HFWeights
from slime_async.trainer import checkpoint, cpu_compat, hf_convert, parallel, weights_io
from slime_async.trainer.config import TrainerConfig, lr_at
from slime_async.trainer.forward import padded_width, token_logprobs
from slime_async.trainer.metrics_agg import MetricAccumulator, broadcast_metrics
from slime_async.trainer.model import build_model
from slime_async.trainer.pipeline import StageExecutor
from slime_async.trainer.replay import (
    RoutingReplay,
    engine_routing_to_replay,
    replay_instances,
)
from slime_async.trainer.snapshots import SnapshotStore

Routing = list[torch.Tensor] | None
free_port = parallel.free_port  # re-exported for callers that start single-rank trainers


class MegatronTrainer:
    """One trainer rank: build → (load | import HF | init) → compute_logprobs / train_step.

    Example (world size 1)::

        tr = MegatronTrainer(TrainerConfig(lr=1e-3), TINY_MOE)
        lp, ent = tr.compute_logprobs(batch)          # π_k, [B, T] token-aligned
        metrics = tr.train_step(batch)                # version 0 → 1
        tr.save_weights("/tmp/w")                     # HF dir for the engines
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        spec: ModelSpec,
        *,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
    ) -> None:
        self.cfg, self.spec = cfg, spec
        self.loss_fn = resolve_loss(cfg.loss_fn)  # fails fast on an unknown name or bad path
        cpu_compat.apply()
        parallel.init_distributed(
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port or parallel.free_port(),
        )
        self.layout = parallel.resolve_layout(
            world_size=world_size,
            tp=cfg.tensor_model_parallel_size,
            ep=cfg.expert_model_parallel_size,
            pp=cfg.pipeline_model_parallel_size,
        )
        if spec.is_moe and spec.num_experts % self.layout.ep:
            raise ValueError(
                f"num_experts={spec.num_experts} is not divisible by EP={self.layout.ep}"
            )
        if spec.num_layers % self.layout.pp:
            raise ValueError(
                f"num_layers={spec.num_layers} is not divisible by PP={self.layout.pp}"
            )
        if spec.tie_word_embeddings and self.layout.pp > 1:
            raise ValueError(
                "tied embeddings with pipeline parallelism are not supported; use PP=1"
            )
        parallel.init_model_parallel(self.layout, seed=cfg.seed)
        self.rank, self.world_size = rank, world_size
        self.model = build_model(spec, self.layout)
        self._routers = list(replay_instances())
        self.stage = StageExecutor(
            self.model, self._routers, tp=self.layout.tp, hidden_size=spec.hidden_size
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=lr_at(0, cfg),
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self.version = 0
        self.extra_state: dict[str, object] = {}
        self.snapshots = SnapshotStore(cfg.max_snapshots)
        self.loaded_from: str | None = None
        self.resumed_layout: parallel.ParallelLayout | None = None
        if cfg.load is not None:
            self.load_checkpoint(cfg.load)
        elif cfg.hf_checkpoint is not None:
            self.import_hf(cfg.hf_checkpoint)
        if cfg.keep_old_actor:
            self.snapshots.snapshot(self.model, self.version)

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
        out = self._behavior_logprobs(mbs, lp_k, routing)
        return None if out is None else self._gather_dp(out, batch.width)

    def _behavior_logprobs(
        self, mbs: list[TrainerBatch], lp_k: list[torch.Tensor], routing: list[Routing]
    ) -> list[torch.Tensor] | None:
        """π_j^Meg per token (each token from its own version's snapshot), or None if any
        needed version is not held (→ CompIS combined-ratio fallback)."""
        if not self.cfg.keep_old_actor:
            return None
        needed = {int(v) for mb in mbs for v in mb.token_versions[mb.loss_mask].unique()}
        # every DP rank must run the same snapshot forwards (collectives inside them)
        needed = parallel.union_ints(needed, parallel.groups()["dp"])
        if any(v != self.version and v not in self.snapshots for v in needed):
            return None
        out = [lp.clone() for lp in lp_k]
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
            for lp_v, i in zip(lps, idx, strict=True):
                out[i] = torch.where(mbs[i].token_versions == v, lp_v, out[i])
        return out

    # ------------------------------------------------------------------ train
    def _loss_inputs(
        self, mb: TrainerBatch, lp: torch.Tensor, lp_k: torch.Tensor, lp_j: torch.Tensor | None,
        n_tok: float | None = None, n_seq: float | None = None,
    ) -> LossInputs:  # fmt: skip
        dev = lp.device  # the forward's device; batch and no-grad log-probs live on CPU

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t[:, 1:].to(dev)

        return LossInputs(
            logprobs=lp[:, 1:],
            proximal_logprobs=cut(lp_k),
            rollout_logprobs=cut(mb.rollout_logprobs),
            behavior_logprobs=None if lp_j is None else cut(lp_j),
            advantages=cut(mb.advantages),
            loss_mask=cut(mb.loss_mask),
            token_versions=cut(mb.token_versions),
            current_version=self.version,
            global_num_tokens=n_tok,
            global_num_seqs=n_seq,
        )

    def train_step(self, batch: TrainerBatch) -> dict[str, float]:
        """One optimizer update on the global `batch`; returns namespaced metrics."""
        t0 = time.perf_counter()
        mbs = self._local(batch)
        self.model.eval()
        r2 = self.cfg.routing_replay is RoutingReplay.R2 and self.spec.is_moe
        routing = [self._engine_routing(mb) for mb in mbs]
        recorded: list[Routing] | None = [] if r2 else None
        lp_k, ent = self._logprobs_local(mbs, routing, record=recorded)
        if recorded is not None:
            routing = recorded
        t1 = time.perf_counter()
        lp_j = self._behavior_logprobs(mbs, lp_k, routing)
        t2 = time.perf_counter()
        counts = torch.zeros(2, dtype=torch.float64)
        for i, mb in enumerate(mbs):
            tok, seq = compis_denominators(
                self._loss_inputs(mb, lp_k[i], lp_k[i], None if lp_j is None else lp_j[i]),
                self.cfg.loss,
            )
            counts += torch.tensor([tok, seq], dtype=torch.float64)
        parallel.all_reduce_sum(counts, parallel.groups()["dp"])
        n_tok, n_seq = float(counts[0]), float(counts[1])

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        acc = MetricAccumulator()
        total = torch.zeros((), dtype=torch.float64)
        for i, mb in enumerate(mbs):
            lp_ji = None if lp_j is None else lp_j[i]

            def head(logits: torch.Tensor, mb: TrainerBatch = mb, i: int = i, lp_ji=lp_ji):
                lp, _ = token_logprobs(logits, mb.tokens, temperature=self.cfg.temperature)
                out = self.loss_fn(
                    self._loss_inputs(mb, lp, lp_k[i], lp_ji, n_tok, n_seq), self.cfg.loss
                )
                return out.loss, out.metrics

            res = self.stage.run(mb.tokens, routing[i], head=head, grad=True)
            if res is None:  # not the last pipeline stage: no loss here
                continue
            total += res[0].detach().double().cpu()
            acc.add(res[1], weight=float(mb.loss_mask.sum()))
            m = mb.loss_mask
            acc.add({"policy/entropy": float(ent[i][m].sum() / max(1, int(m.sum())))},
                    weight=float(m.sum()))  # fmt: skip
        t3 = time.perf_counter()
        named = list(self.model.named_parameters())
        parallel.sync_grads(named, tp=self.layout.tp)
        gnorm = float(parallel.grad_norm(named))
        if not math.isfinite(gnorm):  # same value on every rank: all refuse together
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(
                f"non-finite gradient norm ({gnorm}) in the train step at version {self.version}; "
                "the weights were not updated. Check the batch (rollout log-probs, advantages) "
                "and the loss configuration."
            )
        if self.cfg.clip_grad > 0 and gnorm > self.cfg.clip_grad:
            scale = self.cfg.clip_grad / (gnorm + 1e-6)
            for _, p in named:
                if p.grad is not None:
                    p.grad.mul_(scale)
        lr = lr_at(self.version, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.version += 1
        if self.cfg.keep_old_actor:
            self.snapshots.snapshot(self.model, self.version)
        parallel.all_reduce_sum(total, parallel.groups()["dp"])
        parallel.all_reduce_sum(total, parallel.groups()["pp"])  # only the last stage has a loss
        metrics = acc.reduce(parallel.groups()["dp"] if self.layout.dp > 1 else None)
        if self.layout.pp > 1:
            metrics = broadcast_metrics(
                metrics, src=self.stage.last_rank, group=parallel.groups()["pp"]
            )
        metrics.pop("loss/value", None)  # a micro-batch's share; the step's loss is loss/total
        metrics.update({
            "loss/total": float(total),
            "train/grad_norm": gnorm,
            "train/lr": lr,
            "train/version": float(self.version),
            "train/num_tokens": n_tok,
            "train/num_seqs": n_seq,
            "timing/proximal_logprobs_s": t1 - t0,
            "timing/behavior_logprobs_s": t2 - t1,
            "timing/train_fwd_bwd_s": t3 - t2,
            "timing/train_step_s": time.perf_counter() - t0,
        })  # fmt: skip
        return metrics

    # ------------------------------------------------------------------ versions
    def snapshot(self) -> int:
        """Keep the current weights as a snapshot of `self.version`; returns that version."""
        self.snapshots.snapshot(self.model, self.version)
        return self.version

    def release(self, version: int) -> bool:
        """Drop the snapshot of `version` (no in-flight sample references it any more)."""
        return self.snapshots.release(version)

    # ------------------------------------------------------------------ weights
    def export_weights(self) -> HFWeights:
        """Full HF-named tensors of the current version (collective over TP/EP)."""
        return HFWeights(
            version=self.version,
            spec=self.spec,
            tensors=hf_convert.megatron_to_hf(self.model, self.spec),
        )

    def save_weights(self, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Export and write an HF directory at `path` (rank 0 writes; all ranks return)."""
        w = self.export_weights()
        if self.rank == 0:
            weights_io.write_hf_dir(w, path, dtype=dtype)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        return Path(path)

    def import_hf(self, path: str | Path) -> None:
        """Load weights from an HF directory (warm start / reference); spec must match."""
        w = weights_io.read_hf_dir(path)
        checkpoint.check_spec(w.spec, self.spec, where=str(path))
        hf_convert.hf_to_megatron(self.model, self.spec, w.tensors)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, save_dir: str | Path | None = None, *, extra_state: dict[str, object] | None = None
    ) -> Path:
        """Atomically save model, optimizer, LR schedule, RNG, version and `extra_state`."""
        target = save_dir or self.cfg.save
        if target is None:
            raise ValueError("no checkpoint directory: pass save_dir or set TrainerConfig.save")
        return checkpoint.save(self, Path(target), extra_state=extra_state or {})

    def load_checkpoint(self, load_dir: str | Path) -> None:
        """Resume from `load_dir` (guards: see `checkpoint.load`)."""
        checkpoint.load(self, Path(load_dir))
        self.loaded_from = str(load_dir)

    def shutdown(self) -> None:
        """Free megatron's global state (the process group stays up for reuse)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
