"""Model architecture description shared by the trainer (Megatron) and the engine (HF).

Owns: `ModelSpec`, the one place that names a model's shape, plus conversion to and from a
Hugging Face config. Both sides build their model from the same spec, so exported weights
always fit the engine. Imports nothing from the rest of slime_async.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

Family = Literal["qwen3_moe", "llama"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Architecture of a decoder-only LM (Qwen3-MoE style, or dense Llama style)."""

    family: Family = "qwen3_moe"
    """`qwen3_moe` (RMSNorm, SwiGLU experts, RoPE, qk-norm, top-k router) or `llama` (dense)."""
    vocab_size: int = 4096
    """Vocabulary size (token ids are in [0, vocab_size))."""
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Number of transformer layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 32
    """Per-head width."""
    intermediate_size: int = 256
    """Dense MLP width (llama family, and dense layers of the MoE family)."""
    num_experts: int = 4
    """Routed experts per MoE layer (qwen3_moe only)."""
    moe_topk: int = 2
    """Experts chosen per token."""
    moe_intermediate_size: int = 128
    """Per-expert MLP width."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    max_position_embeddings: int = 2048
    """Longest sequence the model supports."""
    tie_word_embeddings: bool = False
    """Share input embedding and output projection."""
    init_std: float = 0.02
    """Initializer standard deviation for models built from scratch."""

    def __post_init__(self) -> None:
        if self.family not in ("qwen3_moe", "llama"):
            raise ValueError(f"unknown model family {self.family!r}; use 'qwen3_moe' or 'llama'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.family == "qwen3_moe" and not 1 <= self.moe_topk <= self.num_experts:
            raise ValueError(
                f"moe_topk ({self.moe_topk}) must be in [1, num_experts={self.num_experts}]"
            )

    @property
    def is_moe(self) -> bool:
        return self.family == "qwen3_moe"

    def moe_layers(self) -> list[int]:
        """Indices of layers with a routed MoE block (all of them for qwen3_moe)."""
        return list(range(self.num_layers)) if self.is_moe else []

    # ---------------------------------------------------------------- HF conversion
    def to_hf_config(self) -> Any:
        """Build the matching `transformers` config object."""
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.init_std,
            rope_theta=self.rope_theta,
        )
        if self.is_moe:
            from transformers import Qwen3MoeConfig

            return Qwen3MoeConfig(
                **common,
                num_experts=self.num_experts,
                num_experts_per_tok=self.moe_topk,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                output_router_logits=False,
                router_aux_loss_coef=0.0,
            )
        from transformers import LlamaConfig

        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelSpec:
        """Read a spec back from a `transformers` config (or its dict form)."""
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        mtype = d.get("model_type")
        if mtype not in ("qwen3_moe", "llama"):
            raise ValueError(
                f"unsupported model_type {mtype!r}: slime-async supports 'qwen3_moe' and 'llama'"
            )
        heads = d["num_attention_heads"]
        rope = d.get("rope_theta")
        if rope is None:
            rope = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        kwargs: dict[str, Any] = dict(
            family=mtype,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            intermediate_size=d.get("intermediate_size", 4 * d["hidden_size"]),
            rope_theta=float(rope),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            init_std=d.get("initializer_range", 0.02),
        )
        if mtype == "qwen3_moe":
            kwargs.update(
                num_experts=d.get("num_experts") or d["num_local_experts"],
                moe_topk=d["num_experts_per_tok"],
                moe_intermediate_size=d["moe_intermediate_size"],
            )
        return cls(**kwargs)

    # ---------------------------------------------------------------- persistence
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelSpec fields {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> ModelSpec:
        return cls.from_dict(json.loads(Path(path).read_text()))


TINY_MOE = ModelSpec()
"""The embedded default: a ~2M-parameter Qwen3-MoE (2 layers, 4 experts, top-2)."""
