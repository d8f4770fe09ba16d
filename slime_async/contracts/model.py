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

from slime_async.contracts.vision import VisionSpec, refuse_modalities
from slime_async.contracts.vision_spec import VL_FAMILIES
from slime_async.contracts.vl_config import check_vl, text_fields, vl_fields, vl_hf_config

Family = Literal["qwen3_moe", "qwen3", "qwen2", "llama", "mistral", "qwen2_5_vl", "qwen3_vl"]
FAMILIES: tuple[str, ...] = ("qwen3_moe", "qwen3", "qwen2", "llama", "mistral", *VL_FAMILIES)
"""The HF `model_type`s a spec can describe (the family name is the `model_type`)."""
RopeScaling = Literal["llama3"]

_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}
_CONFIGS = {
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen3": "Qwen3Config",
    "qwen2": "Qwen2Config",
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2_5_vl": "Qwen2_5_VLConfig",
    "qwen3_vl": "Qwen3VLConfig",
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Architecture of a decoder-only LM: RMSNorm, SwiGLU MLP (or top-k routed experts), RoPE,
    grouped-query attention. The family fixes what differs between HF model types:

    | family      | q/k/v bias | qk-norm | MLP          |
    |-------------|------------|---------|--------------|
    | `qwen3_moe` | no         | yes     | routed experts |
    | `qwen3`     | no         | yes     | dense        |
    | `qwen2`     | yes        | no      | dense        |
    | `llama`     | no         | no      | dense        |
    | `mistral`   | no         | no      | dense (full attention only) |
    | `qwen2_5_vl`| yes        | no      | dense, mRoPE, a vision encoder (`vision`) |
    | `qwen3_vl`  | no         | yes     | dense, interleaved mRoPE, a vision encoder with DeepStack |
    """

    family: Family = "qwen3_moe"
    """HF model type: `qwen3_moe`, `qwen3`, `qwen2`, `llama`, `mistral`, `qwen2_5_vl` or
    `qwen3_vl`."""
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
    """Dense MLP width (dense families, and dense layers of the MoE family)."""
    num_experts: int = 4
    """Routed experts per MoE layer (qwen3_moe only)."""
    moe_topk: int = 2
    """Experts chosen per token."""
    moe_intermediate_size: int = 128
    """Per-expert MLP width."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling: None (plain RoPE) or `llama3` (Llama 3.1+ long-context scaling,
    the four `rope_*` fields below)."""
    rope_factor: float = 8.0
    """llama3 scaling: low frequencies are divided by this factor."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above original_max_position_embeddings / this are scaled."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below original_max_position_embeddings / this are kept."""
    rope_original_max_position_embeddings: int = 8192
    """llama3 scaling: the context length the model was pretrained with."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    max_position_embeddings: int = 2048
    """Longest sequence the model supports."""
    tie_word_embeddings: bool = False
    """Share input embedding and output projection."""
    init_std: float = 0.02
    """Initializer standard deviation for models built from scratch."""
    mrope_section: tuple[int, ...] | None = None
    """VL families: rotary frequencies (of head_dim / 2) turned by the temporal, height and
    width position ids (multimodal RoPE; qwen3_vl interleaves them: frequency i takes height
    when i % 3 == 1, width when i % 3 == 2, within 3x their sections); None for text."""
    vision: VisionSpec | None = None
    """VL families: the vision encoder; None for text families."""

    def __post_init__(self) -> None:
        if isinstance(self.vision, dict):
            object.__setattr__(self, "vision", VisionSpec.from_dict(self.vision))
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(int(x) for x in self.mrope_section))
        check_vl(self.family, self.vision, self.mrope_section, self.head_dim, self.hidden_size)
        if self.family not in FAMILIES:
            raise ValueError(
                f"unknown model family {self.family!r}; use one of {', '.join(FAMILIES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.family == "qwen3_moe" and not 1 <= self.moe_topk <= self.num_experts:
            raise ValueError(
                f"moe_topk ({self.moe_topk}) must be in [1, num_experts={self.num_experts}]"
            )
        if self.rope_scaling not in (None, "llama3"):
            raise ValueError(f"unknown rope_scaling {self.rope_scaling!r}; use None or 'llama3'")
        if self.rope_scaling == "llama3" and not (
            self.rope_factor > 0 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
        ):
            raise ValueError(
                "llama3 rope scaling needs rope_factor > 0 and 0 < rope_low_freq_factor < "
                f"rope_high_freq_factor (got {self.rope_factor}, {self.rope_low_freq_factor}, "
                f"{self.rope_high_freq_factor})"
            )

    @property
    def is_vl(self) -> bool:
        """A vision-language model (images in the prompt)."""
        return self.vision is not None

    @property
    def is_moe(self) -> bool:
        return self.family == "qwen3_moe"

    @property
    def qkv_bias(self) -> bool:
        """q/k/v projections carry a bias (Qwen2; the output projection never does)."""
        return self.family in ("qwen2", "qwen2_5_vl")

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on queries and keys before RoPE (Qwen3 dense and MoE)."""
        return self.family in ("qwen3", "qwen3_moe", "qwen3_vl")

    @property
    def hf_architecture(self) -> str:
        """The `architectures` entry of the HF config (`Qwen3ForCausalLM`, ...)."""
        return _ARCHITECTURES[self.family]

    def moe_layers(self) -> list[int]:
        """Indices of layers with a routed MoE block (all of them for qwen3_moe)."""
        return list(range(self.num_layers)) if self.is_moe else []

    # ---------------------------------------------------------------- HF conversion
    def to_hf_config(self) -> Any:
        """Build the matching `transformers` config object (`from_hf_config` reads it back)."""
        import transformers

        common: dict[str, Any] = dict(
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
            hidden_act="silu",
            attention_dropout=0.0,
            rope_theta=self.rope_theta,
            architectures=[self.hf_architecture],
        )
        if self.rope_scaling == "llama3":
            common["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_factor,
                "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "original_max_position_embeddings": self.rope_original_max_position_embeddings,
            }
        if self.family in ("llama", "mistral", "qwen3", "qwen3_moe", "qwen3_vl"):
            common["attention_bias"] = False
        if self.family == "llama":
            common["mlp_bias"] = False
        if self.family in ("qwen2", "qwen3", "qwen3_moe", "mistral"):
            common["sliding_window"] = None
        if self.family in ("qwen2", "qwen3", "qwen3_moe"):
            common["use_sliding_window"] = False
        if self.is_moe:
            common.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.moe_topk,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                output_router_logits=False,
                router_aux_loss_coef=0.0,
            )
        if self.is_vl:
            return vl_hf_config(
                common,
                mrope_section=self.mrope_section,
                rope_theta=self.rope_theta,
                tie=self.tie_word_embeddings,
                vision=self.vision,
                architecture=self.hf_architecture,
            )
        return getattr(transformers, _CONFIGS[self.family])(**common)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelSpec:
        """Read a spec from a `transformers` config (or its dict form, e.g. a `config.json`).

        Raises ValueError naming the field and its value for anything the trainer cannot
        represent (another model type, a rope scaling other than llama3, sliding-window
        attention in use, biases other than Qwen2's q/k/v, another activation, ...): such a
        model would train and serve different math, so nothing is silently dropped.
        """
        top = cfg if isinstance(cfg, dict) else cfg.to_dict()
        mtype = top.get("model_type")
        refuse_modalities(mtype)
        d = text_fields(top) if mtype in VL_FAMILIES else top
        if mtype not in FAMILIES:
            raise ValueError(
                f"model_type {mtype!r} is not supported; supported: {', '.join(FAMILIES)}"
            )
        _refuse_unrepresentable(d, mtype)
        heads = d["num_attention_heads"]
        rp = _rope_params(d)
        rope = d.get("rope_theta") or rp.get("rope_theta") or 10000.0
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
        if _rope_type(rp) == "llama3":
            kwargs.update(
                rope_scaling="llama3",
                rope_factor=float(rp["factor"]),
                rope_low_freq_factor=float(rp["low_freq_factor"]),
                rope_high_freq_factor=float(rp["high_freq_factor"]),
                rope_original_max_position_embeddings=int(
                    rp.get("original_max_position_embeddings") or kwargs["max_position_embeddings"]
                ),
            )
        if mtype == "qwen3_moe":
            kwargs.update(
                num_experts=d.get("num_experts") or d["num_local_experts"],
                moe_topk=d["num_experts_per_tok"],
                moe_intermediate_size=d["moe_intermediate_size"],
            )
        if mtype in VL_FAMILIES:
            kwargs.update(vl_fields(top, d, rp))
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


def _rope_params(d: dict[str, Any]) -> dict[str, Any]:
    """The rope parameters of an HF config dict: `rope_parameters` (transformers 5) or
    `rope_scaling` (older config.json files)."""
    return dict(d.get("rope_parameters") or d.get("rope_scaling") or {})


def _rope_type(rp: dict[str, Any]) -> str:
    return str(rp.get("rope_type") or rp.get("type") or "default")


def _refuse_unrepresentable(d: dict[str, Any], mtype: str) -> None:
    """Raise ValueError naming the first HF config field (and its value) whose math the
    trainer does not implement."""

    def refuse(field: str, value: Any, why: str) -> None:
        raise ValueError(f"{mtype} config field {field}={value!r} is not supported: {why}")

    rp = _rope_params(d)
    rtype = _rope_type(rp)
    if mtype in VL_FAMILIES and rtype == "mrope":  # the multimodal RoPE is the default one
        rtype = "default"
    if rtype not in ("default", "llama3"):
        refuse("rope_scaling.rope_type", rtype, "the trainer implements plain RoPE and llama3")
    if rtype == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if rp.get(key) is None:
                refuse(f"rope_scaling.{key}", None, "llama3 rope scaling needs it")
    for src in (d, rp):
        prf = src.get("partial_rotary_factor")
        if prf not in (None, 1, 1.0):
            refuse("partial_rotary_factor", prf, "RoPE must cover the whole head")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        refuse("hidden_act", act, "the MLP is SwiGLU (silu)")
    for field in ("attention_bias", "mlp_bias"):
        if d.get(field):
            refuse(field, d[field], "only Qwen2's q/k/v biases are implemented")
    if d.get("use_sliding_window"):
        refuse("use_sliding_window", True, "sliding-window attention is not implemented")
    window, ctx = d.get("sliding_window"), d.get("max_position_embeddings", 2048)
    if mtype == "mistral" and window is not None and window < ctx:
        refuse(
            "sliding_window",
            window,
            "sliding-window attention is not implemented; it must be null or at least "
            f"max_position_embeddings ({ctx})",
        )
    sliding = [t for t in d.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        refuse("layer_types", sliding[0], "every layer must be full_attention")
    if d.get("attention_dropout"):
        refuse("attention_dropout", d["attention_dropout"], "attention dropout must be 0")
    if mtype == "qwen3_moe":
        if d.get("norm_topk_prob") is False:
            refuse("norm_topk_prob", False, "the router renormalises the top-k probabilities")
        if d.get("decoder_sparse_step", 1) != 1:
            refuse("decoder_sparse_step", d["decoder_sparse_step"], "every layer must be MoE")
        if d.get("mlp_only_layers"):
            refuse("mlp_only_layers", d["mlp_only_layers"], "every layer must be MoE")
        if d.get("shared_expert_intermediate_size"):
            refuse(
                "shared_expert_intermediate_size",
                d["shared_expert_intermediate_size"],
                "shared experts are not implemented",
            )


TINY_MOE = ModelSpec()
"""The embedded default: a ~2M-parameter Qwen3-MoE (2 layers, 4 experts, top-2)."""
SMOLLM2_135M = ModelSpec(
    family="llama",
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    max_position_embeddings=8192,
)
"""SmolLM2-135M's shapes (the recipes' model, read from its GGUF at run time): for benchmarks
and memory estimates that need no weights."""
