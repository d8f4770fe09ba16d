"""Build a megatron-core GPTModel from a `ModelSpec` (Qwen3-MoE style or dense Llama style).

Owns: the ModelSpec → TransformerConfig mapping and model construction. Must never import the
controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime_async.contracts.model import ModelSpec
from slime_async.trainer import cpu_compat
from slime_async.trainer.parallel import ParallelLayout


def transformer_config(
    spec: ModelSpec, layout: ParallelLayout, *, params_dtype: torch.dtype = torch.float32
) -> object:
    """megatron `TransformerConfig` matching `spec` (the HF model's math, op for op)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = not cpu_compat.cuda_available()
    moe: dict[str, object] = {}
    if spec.is_moe:
        moe = dict(
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
    return TransformerConfig(
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
        add_qkv_bias=False,
        qk_layernorm=spec.is_moe,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_std,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.tp,
        sequence_parallel=layout.tp > 1,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        attention_softmax_in_fp32=True,
        cross_entropy_loss_fusion=False,
        **({"attention_backend": _local_attention()} if on_cpu else {}),
        **moe,
    )


def _local_attention() -> object:
    from megatron.core.transformer.enums import AttnBackend

    return AttnBackend.local


def build_model(
    spec: ModelSpec, layout: ParallelLayout, *, params_dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A fresh GPTModel for this rank (parallel_state must be initialised first).

    Clears megatron's global RouterReplay instance list first, so the list holds exactly this
    model's MoE layers in construction order (one per local MoE layer).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    cpu_compat.apply()
    RouterReplay.clear_global_router_replay_instances()
    cfg = transformer_config(spec, layout, params_dtype=params_dtype)
    layer_spec = get_gpt_layer_local_spec(
        num_experts=spec.num_experts if spec.is_moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=spec.is_moe,
        normalization="RMSNorm",
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
    )
    if cpu_compat.cuda_available():
        model = model.cuda()
    return model
