"""Build megatron-core GPTModels from a `ModelSpec` (Qwen3-MoE, or dense Qwen3/Qwen2/Llama/Mistral).

Owns: the ModelSpec → TransformerConfig mapping (including what the trainer's schedule needs:
per-token-loss gradients, variable sequence lengths between pipeline stages, recomputation,
bf16), model construction (one chunk, or one per virtual pipeline stage) on megatron's local
layer spec with packed-sequence attention (`attention.py`) and an output layer that returns
the hidden states for the chunked log-prob head (`lm_head.py`), SwiGLU in one autograd
function (`swiglu.py`), RMSNorm with its own backward on CPU (`norm.py`), the RoPE frequencies
(`rope_inv_freq`, with llama3 scaling), and `global_named_parameters` (the parameters of this
rank's chunks under their global layer numbers). Must never import the controller, engine,
rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from slime_async.contracts.model import ModelSpec
from slime_async.trainer import cpu_compat
from slime_async.trainer.lora import ADAPTER_MARK
from slime_async.trainer.parallel import ParallelLayout


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Recompute:
    """Activation recomputation settings passed to megatron's TransformerConfig."""

    granularity: str | None = None
    """'full', 'selective' or None (off)."""
    method: str | None = None
    """'uniform' or 'block' with 'full'."""
    num_layers: int | None = None
    """Layers per group / recomputed layers with 'full'."""


def transformer_config(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    recompute: Recompute | None = None,
    vp: int | None = None,
) -> object:
    """megatron `TransformerConfig` matching `spec` (the HF model's math, op for op).

    `variable_seq_lengths=True` (pipeline stages send each micro-batch's shape first) is set
    after validation: megatron refuses it with the allgather MoE dispatcher because EP ranks
    must exchange equally many tokens, which the trainer guarantees itself (every EP rank's
    i-th micro-batch has one shape, `packing.shape_floor`); within a TP group all ranks run
    the same micro-batch. Not with virtual stages: megatron sends the shapes of both
    directions in one batched p2p call, which gloo mis-pairs at PP=2; there every micro-batch
    of a step gets one shape instead.

    `calculate_per_token_loss=True`: every micro-batch loss is already its share of the global
    loss (the loss's global denominators), so megatron must neither divide it by the number of
    micro-batches nor average gradients over DP (DDP sums them); the trainer's
    `finalize_model_grads` passes no token count, so nothing rescales them afterwards.
    """
    rc = recompute or Recompute()
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = not cpu_compat.cuda_available()
    cfg = TransformerConfig(
        **_architecture_kwargs(spec),
        **_parallel_kwargs(layout, params_dtype=params_dtype, vp=vp, on_cpu=on_cpu),
        **_unfused_kwargs(),
        recompute_granularity=rc.granularity,
        recompute_method=rc.method,
        recompute_num_layers=rc.num_layers,
        **({"attention_backend": _local_attention()} if on_cpu else {}),
        **_moe_kwargs(spec),
    )
    cfg.variable_seq_lengths = vp is None
    if spec.mrope_section is not None:  # megatron reads it beside position_embedding_type
        cfg.mrope_section = list(spec.mrope_section)
    return cfg


def _architecture_kwargs(spec: ModelSpec) -> dict[str, object]:
    """The HF model's math: shapes, norms, activation, biases, no dropout, init."""
    return dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        layernorm_epsilon=spec.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_std,
    )


def _moe_kwargs(spec: ModelSpec) -> dict[str, object]:
    """The MoE settings (none for a dense model): top-k softmax routing without aux loss,
    allgather dispatch, routing replay, fp32 router."""
    if not spec.is_moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_intermediate_size,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_enable_routing_replay=True,
        moe_router_dtype="fp32",
    )


def _parallel_kwargs(
    layout: ParallelLayout, *, params_dtype: torch.dtype, vp: int | None, on_cpu: bool
) -> dict[str, object]:
    """The parallel layout, the parameter dtype, and the per-token loss the schedule needs."""
    return dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.tp > 1,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        calculate_per_token_loss=True,
        # gloo matches messages between two ranks in posting order: megatron's batched p2p
        # would pair an activation with a gradient when PP=2 sends both ways at once (the
        # interleaved schedule); the unbatched path keeps the two directions apart
        batch_p2p_comm=not on_cpu,
        virtual_pipeline_model_parallel_size=vp,
    )


def _unfused_kwargs() -> dict[str, object]:
    """Every fused kernel off (the reference math, op for op), fp32 softmax."""
    return dict(
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        attention_softmax_in_fp32=True,
        cross_entropy_loss_fusion=False,
        # megatron's default "full" warns that it is deprecated and becomes [], the same scope
        cuda_graph_scope=[],
    )


def _local_attention() -> object:
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend.local


def build_model(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    recompute: Recompute | None = None,
    vp: int | None = None,
    vp_stage: int | None = None,
    clear_routers: bool = True,
) -> torch.nn.Module:
    """A fresh GPTModel (chunk `vp_stage` of `vp`) for this rank; parallel_state first.

    Clears megatron's global RouterReplay instance list first (unless `clear_routers`, for
    the later chunks of one model), so the list holds exactly this model's MoE layers in
    construction order (one per local MoE layer).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from slime_async.trainer import embedding, lm_head, norm, swiglu
    from slime_async.trainer.attention import PackedDotProductAttention

    cpu_compat.apply()
    if clear_routers:
        RouterReplay.clear_global_router_replay_instances()
    cfg = transformer_config(spec, layout, params_dtype=params_dtype, recompute=recompute, vp=vp)
    layer_spec = get_gpt_layer_local_spec(
        num_experts=spec.num_experts if spec.is_moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=spec.qk_norm,
        normalization="RMSNorm",
    )
    layer_spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    first = ps.is_pipeline_first_stage(ignore_virtual=vp is None, vp_stage=vp_stage)
    last = ps.is_pipeline_last_stage(ignore_virtual=vp is None, vp_stage=vp_stage)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=first,
        post_process=last,
        parallel_output=False,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="mrope" if spec.is_vl else "rope",
        rotary_base=int(spec.rope_theta),
        vp_stage=vp_stage,
    )
    if spec.vision is not None and first:
        # the whole vision tower sits beside the embedding (vision.py); its parameters are
        # `vision.*` among the chunk's, in params_dtype like the rest
        from slime_async.trainer.towers import build_tower

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.vision.depth * 7919 + spec.vision.hidden_size)
            model.vision = build_tower(spec.vision).to(params_dtype)
    if spec.family == "qwen3_vl":  # interleaved mRoPE, DeepStack (deepstack.py)
        from slime_async.trainer import deepstack

        deepstack.install(model, spec)
    if spec.rope_scaling is not None:
        # megatron's own llama3 option fixes low/high_freq_factor and the original context
        # (1, 4, 8192); install the spec's frequencies before the first (cached) forward
        model.rotary_pos_emb.inv_freq = rope_inv_freq(spec)
    if last:
        # the head takes hidden states and the output weight: no [tokens, V] tensor (lm_head.py)
        lm_head.install(model)
    swiglu.install(model)  # the gated unit's backward without a concatenation (swiglu.py)
    if not cpu_compat.cuda_available():
        norm.install(model)  # RMSNorm's backward in a few passes (norm.py)
        embedding.install(model)  # its gradient straight into the fp32 buffer (embedding.py)
    if cpu_compat.cuda_available():
        model = model.cuda()
    return model


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """fp32 RoPE inverse frequencies `[head_dim / 2]` of `spec`, with its rope scaling applied.

    llama3 scaling (as Llama 3.1+ and transformers define it): with L the original context and
    wavelength w = 2π / f of each frequency f, frequencies with w < L / high_freq_factor stay,
    those with w > L / low_freq_factor become f / factor, and those in between interpolate
    linearly in s = (L / w − low) / (high − low): (1 − s) · f / factor + s · f.
    """
    dim = spec.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    base = 1.0 / (spec.rope_theta**exponents)
    if spec.rope_scaling is None:
        return base
    if spec.rope_scaling != "llama3":
        raise ValueError(f"rope scaling {spec.rope_scaling!r} is not implemented")
    ctx = spec.rope_original_max_position_embeddings
    low, high, factor = spec.rope_low_freq_factor, spec.rope_high_freq_factor, spec.rope_factor
    wavelen = 2 * math.pi / base
    long_wave = wavelen > ctx / low
    scaled = torch.where(long_wave, base / factor, base)
    s = (ctx / wavelen - low) / (high - low)
    blended = (1 - s) * scaled / factor + s * scaled
    between = ~(wavelen < ctx / high) & ~long_wave
    return torch.where(between, blended, scaled)


def build_chunks(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    recompute: Recompute | None = None,
    vp: int | None = None,
) -> list[torch.nn.Module]:
    """This rank's model chunks: one GPTModel, or `vp` of them (interleaved pipeline)."""
    if vp is not None and spec.num_layers % (layout.pp * vp):
        raise ValueError(
            f"num_layers={spec.num_layers} is not divisible by PP x virtual stages = "
            f"{layout.pp} x {vp}; choose sizes that split the layers evenly"
        )
    stages = [None] if vp is None else list(range(vp))
    chunks = [
        build_model(
            spec,
            layout,
            params_dtype=params_dtype,
            recompute=recompute,
            vp=vp,
            vp_stage=st,
            clear_routers=i == 0,
        )
        for i, st in enumerate(stages)
    ]
    _mark_expert_grads(chunks, layout)
    return chunks


def _mark_expert_grads(chunks: list[torch.nn.Module], layout: ParallelLayout) -> None:
    """Route the experts' gradients to the experts' data-parallel reduction when it differs
    from the dense layers' (ETP < TP with EP 1). megatron-core 0.16.1 marks an expert weight
    for the expert-DP reduction (`allreduce=False`) only when EP > 1, so with EP 1 it is
    reduced over the dense DP ranks alone, and the TP ranks that hold the same whole expert
    (ETP < TP) never sum their shares of its gradient. Marked here, DDP reduces it over the
    expert-DP group and the optimizer steps it with the expert parameters."""
    if layout.ep > 1 or layout.etp == layout.tp:
        return
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".experts." in name:
                param.allreduce = False


def global_named_parameters(chunks: list[torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """Parameters of this rank's (unwrapped) chunks, transformer layers named by their global
    index (`decoder.layers.{layer_number - 1}.…`), whichever stage and chunk holds them.
    LoRA adapters are not among them (`lora.adapter_tensors` has those)."""
    out: dict[str, torch.nn.Parameter] = {}
    for chunk in chunks:
        renames = {}
        decoder = getattr(chunk, "decoder", None)
        for i, layer in enumerate(getattr(decoder, "layers", [])):
            renames[f"decoder.layers.{i}."] = f"decoder.layers.{layer.layer_number - 1}."
        for name, p in chunk.named_parameters():
            if ADAPTER_MARK in name:
                continue
            for local, glob in renames.items():
                if name.startswith(local):
                    name = glob + name[len(local) :]
                    break
            out[name] = p
    return out


def moe_layer_numbers(chunks: list[torch.nn.Module]) -> list[int]:
    """Global indices of this rank's MoE layers, chunk by chunk in layer order."""
    return [i for i, _ in _moe_routers(chunks)]


def router_replays(chunk: torch.nn.Module) -> list[object]:
    """The `RouterReplay` of each MoE layer of `chunk`, in layer order."""
    return [r for _, r in _moe_routers([chunk])]


def _moe_routers(chunks: list[torch.nn.Module]) -> list[tuple[int, object]]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [
        (layer.layer_number - 1, layer.mlp.router.router_replay)
        for chunk in chunks
        for layer in getattr(getattr(chunk, "decoder", None), "layers", [])
        if isinstance(layer.mlp, MoELayer)
    ]
