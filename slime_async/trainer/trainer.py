"""`MegatronTrainer`: the Ray-free trainer core (one instance per trainer rank). One
responsibility over 400 lines: a rank's model and optimizer, from build to release.

Owns: the model chunks and optimizer of this rank (megatron DDP + megatron optimizer,
`optim.py`), the train step of the selected loss (computing only the inputs its `LossSpec`
declares: `_step_inputs` → `_denominators` → `_forward_backward` (megatron's schedule,
`schedule.py`) → `_optimizer_step`), the version counter, weight export and checkpoint
hooks. The no-grad forwards (π_k, π_j^Meg via snapshots, routing replay) are its mixin
`LogprobForwards` (`logprobs.py`). Must never import the controller, engine, rollout or
data-worker parts of `slime_async` (the Ray wrapper lives in `actor.py`).

Every rank of a trainer group receives the same *global* `TrainerBatch`; each data-parallel
rank works on its contiguous shard and results are gathered back, so callers never slice.
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from loss import denominators, resolve_loss_spec
from loss.regularizers import with_regularizers
from slime_async.contracts.adapter import adapter_dir, lora_spec, write_peft_dir
from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weights import HFWeights
from slime_async.trainer import (
    checkpoint,
    cpu_compat,
    fused,
    hf_convert,
    hf_save,
    lora,
    megatron_ckpt,
    parallel,
    quiet,
    share,
    weights_io,
)
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.forward import position_logprobs
from slime_async.trainer.logprobs import LogprobForwards
from slime_async.trainer.loss_inputs import StepInputs, check_loss_needs, loss_inputs
from slime_async.trainer.metrics_agg import MetricAccumulator, broadcast_metrics
from slime_async.trainer.model import (
    Recompute,
    build_chunks,
    moe_layer_numbers,
    router_replays,
)
from slime_async.trainer.offload import TrainerOffload, WeightCache
from slime_async.trainer.optim import build_optim
from slime_async.trainer.reference import maybe_reference
from slime_async.trainer.replay import RoutingReplay
from slime_async.trainer.schedule import MicroBatch, Schedule
from slime_async.trainer.snapshots import SnapshotStore

log = logging.getLogger(__name__)


def use_deterministic_algorithms() -> None:
    """`--deterministic-mode`: PyTorch's deterministic algorithms in this process (cuBLAS needs
    a fixed workspace for them, set before the first CUDA matmul unless already set)."""
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


free_port = parallel.free_port  # re-exported for callers that start single-rank trainers


class MegatronTrainer(LogprobForwards):
    """One trainer rank: build → (load | import HF | init) → compute_logprobs / train_step.

    Example (world size 1)::

        tr = MegatronTrainer(TrainerConfig(lr=1e-3), TINY_MOE)
        lp, ent = tr.compute_logprobs(batch)          # π_k, [B, T] where batch.loss_mask
        metrics = tr.train_step(batch)                # version 0 → 1 (tr.version)
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
        hf_from_rank0: bool = False,
    ) -> None:
        """`hf_from_rank0`: rank 0 reads `cfg.hf_checkpoint` and sends it to the other ranks
        (their nodes do not hold it; `share.broadcast_hf_weights`)."""
        quiet.quiet_optional_dependency_warnings()  # before megatron's first import here
        self.cfg, self.spec = cfg, spec
        self._resolve_loss(rank)
        if cfg.deterministic_mode:
            use_deterministic_algorithms()
        on_cpu = cpu_compat.apply()
        fused.install(cfg.cpu_fused_kernels and on_cpu)  # a CPU trainer's kernels (fused.py)
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
            etp=cfg.expert_tensor_parallel_size,
        )
        parallel.check_model_layout(spec, self.layout)
        vp = cfg.virtual_pipeline_model_parallel_size
        parallel.init_model_parallel(self.layout, seed=cfg.seed, vp=vp)
        self.rank, self.world_size = rank, world_size
        self.chunks = build_chunks(
            spec,
            self.layout,
            recompute=_recompute(cfg),
            vp=vp,
            params_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
        )
        _freeze_vision(self.chunks, cfg, self.layout, spec)
        self.lora = lora_spec(cfg, spec)  # LoRA: adapters on the frozen base, see lora.py
        if self.lora is not None:
            lora.attach(self.chunks, spec, self.lora, seed=cfg.seed)
        self.model = self.chunks[0] if len(self.chunks) == 1 else torch.nn.ModuleList(self.chunks)
        self.moe_layers = moe_layer_numbers(self.chunks)
        self.optim = build_optim(self.chunks, cfg, self.layout)
        weakref.finalize(self, parallel.drop_stale_graphs, self.chunks)  # see its docstring
        if rank == 0:
            self._log_derived()
        self.schedule = Schedule(
            self.optim.wrapped,
            [router_replays(c) for c in self.chunks],
            recompute=cfg.recompute_granularity is not None,
            chunks=self.chunks,
            chunk_tokens=cfg.logits_chunk_tokens,
            vision=spec.vision,
            images=_images(cfg, spec),
        )
        self.version = 0
        self.extra_state: dict[str, object] = {}
        self.snapshots = SnapshotStore(
            cfg.max_snapshots, keep=None if self.lora is None else lora.is_adapter_param
        )
        self.loaded_from: str | None = None
        self.resumed_layout: parallel.ParallelLayout | None = None
        self._load_start_weights(hf_from_rank0=hf_from_rank0)
        self.optim.set_version(self.version)
        if self.keeps_snapshots:
            self.snapshots.snapshot(self.model, self.version)
        self.reference = maybe_reference(self)  # KL penalty: π_ref weights (initial or --ref-load)
        # sleep and wake of this rank's state; the newest weights on the CPU (filled by `sleep`)
        self.offload, self.weight_cache = TrainerOffload(self), WeightCache()

    def _log_derived(self) -> None:
        """What the trainer derives from its layout (rank 0 says it once)."""
        if self.cfg.use_distributed_optimizer is None and self.layout.dp > 1:
            log.info("derived: --use-distributed-optimizer on (DP=%d)", self.layout.dp)
        if self.cfg.ckpt_format is None and self.lora is not None:
            log.info("derived: --ckpt-format torch (LoRA adapters are saved gathered)")

    def _resolve_loss(self, rank: int) -> None:
        """The loss of `cfg.loss` (fails fast on a bad name or path; entropy / KL-to-reference
        terms wrap it) and its config; rank 0 warns about inputs the loss cannot get."""
        cfg = self.cfg
        self.loss_spec = with_regularizers(resolve_loss_spec(cfg.loss.name), cfg.loss.regularizers)
        self.loss_cfg = self.loss_spec.config(cfg.loss.config)
        warning = check_loss_needs(
            self.loss_spec,
            moe=self.spec.is_moe,
            routing_replay=cfg.routing_replay is not RoutingReplay.NONE,
            keep_old_actor=cfg.keep_old_actor,
        )
        if warning and rank == 0:
            log.warning(warning)

    def _load_start_weights(self, *, hf_from_rank0: bool) -> None:
        """Resume from `cfg.load`, else import `cfg.start_from` (an HF directory or a Megatron
        torch_dist checkpoint), else `cfg.hf_checkpoint` (read by rank 0 and broadcast with
        `hf_from_rank0`), else keep the initialised weights."""
        cfg = self.cfg
        if cfg.load is not None:
            self.load_checkpoint(cfg.load)
        elif cfg.start_from is not None:  # --load naming weights, not a checkpoint of ours
            self.import_weights_dir(cfg.start_from)
        elif cfg.hf_checkpoint is not None and hf_from_rank0 and self.world_size > 1:
            w = share.broadcast_hf_weights(cfg.hf_checkpoint, rank=self.rank)
            self.import_weights(w, where=str(cfg.hf_checkpoint))
        elif cfg.hf_checkpoint is not None:
            self.import_hf(cfg.hf_checkpoint)

    # ------------------------------------------------------------------ train
    def train_step(self, batch: TrainerBatch) -> dict[str, float]:
        """One optimizer update on the global `batch`; returns namespaced metrics. Computes only
        the inputs the loss declares (`self.loss_spec.needs`): which forwards ran is reported
        as `train/proximal_forwards` and `train/behavior_forwards` (micro-batch passes)."""
        t0 = time.perf_counter()
        mbs = self._local(batch)
        inputs = self._step_inputs(mbs)
        t1 = time.perf_counter()
        n_tok, n_seq = self._denominators(mbs, inputs)
        total, acc = self._forward_backward(mbs, inputs, n_tok, n_seq)
        t2 = time.perf_counter()
        gnorm, lr = self._optimizer_step()
        metrics = self._reduce_metrics(total, acc)
        metrics.update(
            {
                "train/grad_norm": gnorm,
                "train/lr": lr,
                "train/version": float(self.version),
                "train/num_tokens": n_tok,
                "train/num_seqs": n_seq,
                "train/micro_batches": float(len(mbs)),
                **inputs.metrics,
                "timing/train_fwd_bwd_s": t2 - t1,
                "timing/train_step_s": time.perf_counter() - t0,
            }
        )
        if math.isfinite(self.optim.grad_cosine):  # none on the first step
            metrics["train/grad_cosine"] = self.optim.grad_cosine
        return metrics

    def _denominators(self, mbs: list[MicroBatch], inputs: StepInputs) -> tuple[float, float]:
        """Global (tokens, sequences) of the loss's denominators over micro-batches and DP."""
        fn = self.loss_spec.needs.denominators
        own = fn is not None and self.loss_spec.needs.denominators_need_logprobs(self.loss_cfg)
        counts = torch.zeros(2, dtype=torch.float64)
        for i, m in enumerate(mbs):
            mb = m.batch
            if not own:  # valid tokens/sequences of the loss mask: no forward needed
                tok, seq = denominators(mb.loss_mask[:, 1:])
            else:
                assert inputs.proximal is not None  # LossNeeds: a function needs π_k
                lp_k = self._old_logprobs(mb, inputs.proximal[i])
                mb_in = loss_inputs(mb, lp_k, lp_k, inputs.behavior_of(i), version=self.version)
                tok, seq = fn(mb_in, self.loss_cfg)
            counts += torch.tensor([tok, seq], dtype=torch.float64)
        parallel.all_reduce_sum(counts, parallel.groups()["dp"])
        return float(counts[0]), float(counts[1])

    def _forward_backward(
        self, mbs: list[MicroBatch], inputs: StepInputs, n_tok: float, n_seq: float
    ) -> tuple[torch.Tensor, MetricAccumulator]:
        """Training forward + loss + backward of every micro-batch through megatron's schedule
        (each loss is its share of the batch loss); returns the summed loss of this rank and
        the accumulated metrics (both empty off the last pipeline stage)."""
        self.optim.zero_grad()
        index = {id(m): i for i, m in enumerate(mbs)}

        def head(logits: torch.Tensor, m: MicroBatch) -> tuple[torch.Tensor, tuple]:
            i, mb = index[id(m)], m.batch
            lp_pos, ent_pos = position_logprobs(
                logits, m.input_ids, temperature=self.cfg.temperature, read=self.head_reads(m)
            )
            lp, ent = m.to_samples(lp_pos), m.to_samples(ent_pos.detach())
            # an entropy bonus needs the entropy with its gradient
            ent_grad = m.to_samples(ent_pos) if self.loss_spec.needs.entropy else None
            # without a π_k forward: the same weights (one update per step), detached
            lp_k = self._old_logprobs(
                mb, lp.detach() if inputs.proximal is None else inputs.proximal[i]
            )
            lp_j = inputs.behavior_with_current(i, lp_k, mb.token_versions, self.version)
            mb_in = loss_inputs(
                mb,
                lp,
                lp_k,
                lp_j,
                version=self.version,
                num_tokens=n_tok,
                num_seqs=n_seq,
                entropy=ent_grad,
                reference=inputs.reference_of(i),
            )
            out = self.loss_spec.fn(mb_in, self.loss_cfg)
            if inputs.entropy is not None:
                ent = inputs.entropy[i]
            mask = mb.loss_mask.to(ent.device)
            h = float(torch.where(mask, ent, 0.0).sum()) / max(1, int(mask.sum()))
            return out.loss, (out.loss.detach(), {**out.metrics, "policy/entropy": h})

        total = torch.zeros((), dtype=torch.float64)
        acc = MetricAccumulator()
        for m, (loss, metrics) in zip(mbs, self.schedule.run(mbs, head, forward_only=False)):
            total += loss.double().cpu()
            acc.add(metrics, weight=float(m.batch.loss_mask.sum()))
        return total, acc

    def _old_logprobs(self, mb: TrainerBatch, lp_k: torch.Tensor) -> torch.Tensor:
        """The loss's old policy `[b, w]`: π_k (`lp_k`), or with --use-rollout-logprobs the
        engine's log-probs of the sampled tokens (slime's), on `lp_k`'s device and dtype."""
        if not self.cfg.use_rollout_logprobs:
            return lp_k
        return mb.rollout_logprobs.to(device=lp_k.device, dtype=lp_k.dtype)

    def _optimizer_step(self) -> tuple[float, float]:
        """Clip and apply megatron's optimizer update (grads were reduced by the schedule's
        `finalize_model_grads`), version += 1 (and its snapshot); refuses a non-finite
        gradient norm on every rank together. Returns (grad norm, lr)."""
        gnorm, lr = self.optim.step(version=self.version, clip_grad=self.cfg.clip_grad)
        self.version += 1
        if self.keeps_snapshots:
            self.snapshots.snapshot(self.model, self.version)
        return gnorm, lr

    def _reduce_metrics(self, total: torch.Tensor, acc: MetricAccumulator) -> dict[str, float]:
        """The step's loss (`loss/total`, summed over DP and pipeline stages) and the loss's
        metrics reduced over micro-batches and DP ranks."""
        parallel.all_reduce_sum(total, parallel.groups()["dp"])
        parallel.all_reduce_sum(total, parallel.groups()["pp"])  # only the last stage has a loss
        metrics = acc.reduce(parallel.groups()["dp"] if self.layout.dp > 1 else None)
        if self.layout.pp > 1:
            from megatron.core import parallel_state as ps

            metrics = broadcast_metrics(
                metrics,
                src=ps.get_pipeline_model_parallel_last_rank(),
                group=parallel.groups()["pp"],
            )
        metrics.pop("loss/value", None)  # a micro-batch's share; the step's loss is loss/total
        metrics["loss/total"] = float(total)
        return metrics

    # ------------------------------------------------------------------ versions
    @property
    def keeps_snapshots(self) -> bool:
        """Snapshots are kept with `keep_old_actor`, unless a forward-only role computes π_j^Meg
        (`behavior_forward="role"`): then that role holds the versions' weights."""
        return self.cfg.keep_old_actor and self.cfg.behavior_forward == "trainer"

    def snapshot(self) -> int:
        """Keep the current weights as a snapshot of `self.version`; returns that version."""
        self.snapshots.snapshot(self.model, self.version)
        return self.version

    def release(self, version: int) -> bool:
        """Drop the snapshot of `version` (no in-flight sample references it any more)."""
        return self.snapshots.release(version)

    # ------------------------------------------------------------------ sleep and wake
    def sleep(self, *, cache_weights: bool = True) -> int:
        """Put the newest version into the CPU weight cache (unless it holds it already), then
        offload parameters, gradients and optimizer state (`offload.py`); returns the bytes
        freed. Nothing of this rank may run until `wake`."""
        if cache_weights and self.weight_cache.version != self.version:
            self.weight_cache.put(self.export_weights())
        return self.offload.offload()

    def wake(self) -> None:
        """Everything `sleep` offloaded back, bit for bit: training goes on as if it never
        slept."""
        self.offload.restore()

    def _cached_weights(self) -> HFWeights:
        w = self.weight_cache.weights
        if w is None or w.version != self.version:
            raise RuntimeError(
                f"the trainer is offloaded and its CPU weight cache holds version "
                f"{self.weight_cache.version}, not its version {self.version}: wake it first"
            )
        return w

    # ------------------------------------------------------------------ weights
    def export_weights(self, *, copy: bool = True) -> HFWeights:
        """Full HF-named tensors of the current version (collective over TP/EP); with LoRA the
        adapters merged into the base (`W + (alpha / r) · B A`). `copy=False` (a weight push
        that reads them at once, before the next step): views of the parameters where the
        layout allows, in their dtype (`hf_convert.megatron_to_hf`); with LoRA always fp32
        copies, as the merge has to make them anyway. While asleep: the CPU weight cache (the
        version `sleep` put there; no collective)."""
        if self.offload.asleep:
            return self._cached_weights()
        tensors = hf_convert.megatron_to_hf(
            self.chunks, self.spec, copy=copy or self.lora is not None
        )
        if self.lora is not None:
            tensors = lora.merge(tensors, self.export_adapter(), self.lora)
        return HFWeights(version=self.version, spec=self.spec, tensors=tensors)

    def write_weights_file(self, path: str | Path) -> int:
        """Write the current version as one safetensors file at `path` in the parameters'
        dtype, tensor by tensor from views of the parameters (`weights_io.write_tensor_file`:
        no model-sized copy), for a process on this node that maps it (the forward-only role).
        Where rank 0 holds every parameter whole (`holds_whole_model`) the file holds the
        parameters themselves, under their own names (`weights_io.PARAMS_LAYOUT`): the role
        then serves the mapped file as the version, no conversion and no copy; otherwise the
        HF export. A collective like `export_weights`; rank 0 writes and returns the bytes, the
        others 0."""
        meta = {"format": "pt", "weight_version": str(self.version)}
        if self.holds_whole_model():
            if self.rank != 0:
                return 0
            meta["layout"] = weights_io.PARAMS_LAYOUT
            params = {n: p.detach() for n, p in self.model.named_parameters()}
            return weights_io.write_tensor_file(params, path, metadata=meta)
        tensors = self.export_weights(copy=False)
        dtype = torch.bfloat16 if self.cfg.bf16 else torch.float32
        if self.rank != 0:
            return 0
        return weights_io.write_tensor_file(tensors.tensors, path, dtype=dtype, metadata=meta)

    def _hf_for_writing(
        self, adapter: dict[str, torch.Tensor] | None
    ) -> tuple[HFWeights, weights_io.Transform | None]:
        """The current version as a save writes it (collective like `export_weights`): the
        HF-named tensors as views of the parameters wherever the layout allows (no
        model-sized copy; `hf_convert.megatron_to_hf`) and, given an `adapter`
        (`export_adapter()`), its fold into each weight as it is written (`lora.merger`); None
        writes the base as it is. They must be written before the parameters change. While
        asleep: the CPU weight cache, merged already."""
        if self.offload.asleep:
            return self._cached_weights(), None
        tensors = hf_convert.megatron_to_hf(self.chunks, self.spec, copy=False)
        fold = None if adapter is None else lora.merger(adapter, self.lora)
        return HFWeights(version=self.version, spec=self.spec, tensors=tensors), fold

    def holds_whole_model(self) -> bool:
        """Every rank holds every parameter whole, in one model chunk, in the layout a
        world-size-1 model of the same spec has (no TP/PP/EP split), awake, without LoRA."""
        lay = self.layout
        split = (lay.tp, lay.pp, lay.ep, lay.etp) != (1, 1, 1, 1) or len(self.chunks) != 1
        return not split and self.lora is None and not self.offload.asleep

    def export_adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter in PEFT's keys (full fp32 tensors; collective over TP/PP)."""
        if self.lora is None:
            raise ValueError("this trainer has no adapter (--lora-rank 0)")
        return lora.adapter_tensors(self.chunks, self.spec, self.lora)

    def save_base_weights(self, path: str | Path) -> Path:
        """With LoRA: write the frozen base (no adapter merged) as an HF directory, what LoRA
        engines serve the adapter over; without LoRA the same as `save_weights`."""
        if self.lora is None:
            return self.save_weights(path)
        w, _ = self._hf_for_writing(None)
        if self.rank == 0:
            weights_io.write_hf_dir(w, path, dtype=torch.float32, source=self.cfg.hf_source)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        return Path(path)

    def save_adapter(self, path: str | Path) -> Path:
        """Write the adapter as a PEFT directory at `path` (rank 0 writes; all ranks return)."""
        tensors = self.export_adapter()
        if self.rank == 0:
            write_peft_dir(
                path, tensors, self.lora, version=self.version, base_model=self.cfg.hf_source
            )
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        return Path(path)

    def save_weights(self, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Export and write an HF directory at `path` (rank 0 writes; all ranks return), in
        `dtype` (default fp32), tensor by tensor (`_hf_for_writing`)."""
        w, fold = self._hf_for_writing(self.export_adapter() if self.lora is not None else None)
        if self.rank == 0:
            weights_io.write_hf_dir(
                w, path, dtype=dtype or torch.float32, source=self.cfg.hf_source, transform=fold
            )
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        return Path(path)

    def save_hf(self, out: str | Path | None = None) -> Path:
        """Write the current weights as a loadable HF directory at `out` (default
        `TrainerConfig.save_hf`; see `hf_save`); rank 0 writes, all ranks return."""
        target = out or self.cfg.save_hf
        if target is None:
            raise ValueError("no HF directory: pass out or set TrainerConfig.save_hf")
        adapter = self.export_adapter() if self.lora is not None else None
        w, fold = self._hf_for_writing(adapter)  # with LoRA: merged as it is written
        if self.rank == 0:  # neither directory is touched unless both are --save-hf's own
            hf_save.check_writable(target, lora=adapter is not None)
            hf_save.write(w, target, source=self.cfg.hf_source, dtype=torch.float32, transform=fold)
            if adapter is not None:  # and the PEFT adapter beside it (docs/lora.md)
                hf_save.write_adapter(
                    adapter,
                    self.lora,
                    adapter_dir(target),
                    version=self.version,
                    base_model=self.cfg.hf_source,
                )
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()
        return Path(target)

    def import_hf(self, path: str | Path) -> None:
        """Load weights from an HF directory (warm start / reference); spec must match."""
        self.import_weights(weights_io.read_hf_dir(path), where=str(path))

    def import_weights_dir(self, path: str | Path) -> None:
        """Load weights from an HF directory or a Megatron torch_dist checkpoint (slime's
        converter's output), told apart by what `path` holds (`megatron_ckpt.weights_dir`);
        ValueError naming `path` when it is neither or does not fit the model."""
        found = megatron_ckpt.weights_dir(Path(path))
        if isinstance(found, str):
            raise ValueError(f"{path} {found}")
        if found.kind == "hf":
            self.import_hf(found.path)
            return
        megatron_ckpt.load_megatron_weights(self.chunks, found.path)
        self.optim.reload_main_params()

    def import_weights(self, w: HFWeights, *, where: str = "exported weights") -> None:
        """Load exported weights held in memory (`export_weights` of a trainer with the same
        spec); `where` names their source in the spec-mismatch error."""
        checkpoint.check_spec(w.spec, self.spec, where=where)
        hf_convert.hf_to_megatron(self.chunks, self.spec, w.tensors)
        self.optim.reload_main_params()

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
        self.optim.set_version(self.version)
        self.loaded_from = str(load_dir)

    def shutdown(self) -> None:
        """Free megatron's global state and destroy its process groups (the default process
        group stays up for reuse)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
        parallel.drop_stale_graphs(self.chunks)
        self.optim.wrapped.clear()
        parallel.release_model_parallel()


def _freeze_vision(
    chunks: list[torch.nn.Module], cfg: TrainerConfig, layout: object, spec: ModelSpec
) -> None:
    """--freeze-vision-tower: the vision tower gets no gradient and no optimizer state. Refuses
    training it with TP > 1 (it is replicated, not tensor-parallel, and its gradients would
    differ between TP ranks)."""
    if spec.vision is None:
        return
    if not cfg.freeze_vision_tower and getattr(layout, "tp", 1) > 1:
        raise ValueError(
            "the vision tower is not tensor-parallel: with --tensor-model-parallel-size > 1 "
            "give --freeze-vision-tower (train the language model only)"
        )
    if cfg.freeze_vision_tower:
        for c in chunks:
            if getattr(c, "vision", None) is not None:
                c.vision.requires_grad_(False)


def _images(cfg: TrainerConfig, spec: ModelSpec) -> object:
    """The resolver of images that come by reference (vision-language models), else None."""
    if spec.vision is None:
        return None
    from slime_async.trainer.vl_inputs import ImageResolver

    return ImageResolver(cfg.hf_source or cfg.hf_checkpoint, spec.vision)


def _recompute(cfg: TrainerConfig) -> Recompute:
    """The activation recompute the config asks for (`--recompute-*`)."""
    return Recompute(
        granularity=cfg.recompute_granularity,
        method=cfg.recompute_method,
        num_layers=cfg.recompute_num_layers,
    )
