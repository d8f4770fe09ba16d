"""The names and shapes of the tensors `save_pretrained` writes for a `ModelSpec`.

Owns: `hf_shapes` (name → shape, every family: the language model under its family's prefix,
the vision tower's tensors for the VL families) and `hf_names`. The mapping itself is
`hf_convert.py`'s. Must never import the controller, engine, rollout or data-worker parts of
`slime_async`.
"""

from __future__ import annotations

from slime_async.contracts.model import ModelSpec
from slime_async.trainer.towers import hf_prefixes, tower_shapes


def hf_names(spec: ModelSpec) -> set[str]:
    """Every tensor name `save_pretrained` writes for a model of this spec."""
    return set(hf_shapes(spec))


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor `save_pretrained` writes for a model of this spec."""
    h, v, hd = spec.hidden_size, spec.vocab_size, spec.head_dim
    lm, vis = hf_prefixes(spec.family)
    shapes: dict[str, tuple[int, ...]] = {
        lm + "embed_tokens.weight": (v, h),
        lm + "norm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    if spec.vision is not None:
        shapes.update({vis + k: v for k, v in tower_shapes(spec.vision).items()})
    for i in range(spec.num_layers):
        pre = f"{lm}layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "post_attention_layernorm.weight"] = (h,)
        shapes[pre + "self_attn.q_proj.weight"] = (spec.num_attention_heads * hd, h)
        shapes[pre + "self_attn.k_proj.weight"] = (spec.num_key_value_heads * hd, h)
        shapes[pre + "self_attn.v_proj.weight"] = (spec.num_key_value_heads * hd, h)
        shapes[pre + "self_attn.o_proj.weight"] = (h, spec.num_attention_heads * hd)
        if spec.qkv_bias:
            shapes[pre + "self_attn.q_proj.bias"] = (spec.num_attention_heads * hd,)
            shapes[pre + "self_attn.k_proj.bias"] = (spec.num_key_value_heads * hd,)
            shapes[pre + "self_attn.v_proj.bias"] = (spec.num_key_value_heads * hd,)
        if spec.qk_norm:
            shapes[pre + "self_attn.q_norm.weight"] = (hd,)
            shapes[pre + "self_attn.k_norm.weight"] = (hd,)
        if spec.is_moe:
            shapes[pre + "mlp.gate.weight"] = (spec.num_experts, h)
            f = spec.moe_intermediate_size
            for e in range(spec.num_experts):
                shapes[pre + f"mlp.experts.{e}.gate_proj.weight"] = (f, h)
                shapes[pre + f"mlp.experts.{e}.up_proj.weight"] = (f, h)
                shapes[pre + f"mlp.experts.{e}.down_proj.weight"] = (h, f)
        else:
            f = spec.intermediate_size
            shapes[pre + "mlp.gate_proj.weight"] = (f, h)
            shapes[pre + "mlp.up_proj.weight"] = (f, h)
            shapes[pre + "mlp.down_proj.weight"] = (h, f)
    return shapes
