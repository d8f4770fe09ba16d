"""A forward-only model: the trainer's model and log-prob forwards, without anything to train.

Owns `ForwardOnlyModel`: the model chunks built exactly as `MegatronTrainer` builds them (the
same `TransformerConfig`, layer spec, chunked log-prob head and megatron schedule, so a forward
computes what the trainer's computes), but with no DDP wrapper and its gradient buffers, no
optimizer (neither Adam's moments nor fp32 main weights) and parameters that require no
gradient: the weights themselves and nothing else (a bf16 model is wrapped in megatron's
`Float16Module`, which holds no tensors, as the trainer's is). With `lora_rank` the trainer's
adapters are attached the same way (`trainer.lora.attach`, fp32 under bf16), so the base is
held once and an adapter version is loaded by `import_adapter`. Used by the forward-only role
(`behavior_role.py`). World size 1. Must never import the controller, engine, rollout or
data-worker parts of `slime_async`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loss import resolve_loss_spec
from slime_async.contracts.adapter import lora_spec
from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weights import HFWeights
from slime_async.trainer import (
    checkpoint,
    cpu_compat,
    fused,
    hf_convert,
    lora,
    parallel,
    quiet,
    weights_io,
)
from slime_async.trainer.config import TrainerConfig
from slime_async.trainer.logprobs import LogprobForwards
from slime_async.trainer.model import build_chunks, moe_layer_numbers, router_replays
from slime_async.trainer.schedule import Schedule
from slime_async.trainer.snapshots import SnapshotStore


class ForwardOnlyModel(LogprobForwards):
    """`compute_logprobs` (π under the loaded weights, or a kept snapshot) and weight import.

    Example::

        fwd = ForwardOnlyModel(cfg, spec)
        fwd.import_hf("run/weights/v000004")
        lp, ent = fwd.compute_logprobs(batch)     # [B, T], as MegatronTrainer computes them
    """

    def __init__(self, cfg: TrainerConfig, spec: ModelSpec) -> None:
        quiet.quiet_optional_dependency_warnings()
        self.cfg, self.spec = cfg, spec
        self.loss_spec = resolve_loss_spec("ppo")
        self.loss_cfg = self.loss_spec.config()
        on_cpu = cpu_compat.apply()
        fused.install(cfg.cpu_fused_kernels and on_cpu)  # a CPU trainer's kernels (fused.py)
        parallel.init_distributed(
            rank=0, world_size=1, master_addr="127.0.0.1", master_port=parallel.free_port()
        )
        self.layout = parallel.resolve_layout(world_size=1, tp=1, ep=1, pp=1)
        parallel.init_model_parallel(self.layout, seed=cfg.seed)
        dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        self.chunks = build_chunks(spec, self.layout, params_dtype=dtype)
        self.lora = lora_spec(cfg, spec)
        if self.lora is not None:  # the trainer's adapters, on the same frozen base
            lora.attach(self.chunks, spec, self.lora, seed=cfg.seed)
        for c in self.chunks:
            c.requires_grad_(False)
        self.model = self.chunks[0]
        self.moe_layers = moe_layer_numbers(self.chunks)
        wrapped = self.chunks
        if cfg.bf16:
            from megatron.core.transformer.module import Float16Module

            wrapped = [lora.keep_fp32(Float16Module(c.config, c)) for c in self.chunks]
        self.schedule = Schedule(
            wrapped,
            [router_replays(c) for c in self.chunks],
            recompute=False,
            chunks=self.chunks,
            chunk_tokens=cfg.logits_chunk_tokens,
            vision=spec.vision,
            images=_images(cfg, spec),
        )
        self.version = 0
        self.snapshots = SnapshotStore(1)

    def import_hf(self, path: str | Path) -> None:
        """Load weights from an HF directory (the trainer's export); spec must match."""
        self.import_weights(weights_io.read_hf_dir(path), where=str(path))

    def import_weights(self, w: HFWeights, *, where: str = "exported weights") -> None:
        """Load exported weights held in memory (`MegatronTrainer.export_weights`)."""
        checkpoint.check_spec(w.spec, self.spec, where=where)
        hf_convert.hf_to_megatron(self.chunks, self.spec, w.tensors)

    def import_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load a LoRA adapter (PEFT keys, full tensors: `MegatronTrainer.export_adapter` or a
        PEFT directory's) over the base; ValueError when this model has no adapters or the
        tensors do not fit them."""
        if self.lora is None:
            raise ValueError("an adapter was given to a forward-only model without --lora-rank")
        from slime_async.contracts.adapter import check_adapter

        check_adapter(tensors, self.lora, self.spec)
        lora.load_adapter_tensors(self.chunks, tensors)

    def parameter_bytes(self) -> int:
        """Bytes of every tensor this model holds (its parameters; nothing else)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def _images(cfg: TrainerConfig, spec: ModelSpec) -> object:
    """The resolver of images that come by reference (vision-language models), else None."""
    if spec.vision is None:
        return None
    from slime_async.trainer.vl_inputs import ImageResolver

    return ImageResolver(cfg.hf_source or cfg.hf_checkpoint, spec.vision)
