"""The flags slime's launch scripts pass that configure nothing here by themselves: Megatron's
model-shape flags (checked against the model the run trains) and the run flags whose slime
meaning is either what happens here anyway or not available here.

Owns `ModelShapeFlags` (Megatron's `--num-layers`, `--hidden-size`, ... as slime's
`scripts/models/<model>.sh` pass them), `ScriptRunFlags` (Megatron's and slime's run flags of
those scripts: `--sequence-parallel`, `--attention-dropout`, `--optimizer`, `--rollout-shuffle`,
...), `add_script_args`, and the two checks the `script_flags` rule runs: `check_shape` (each
given shape flag against the `ModelSpec` the run builds from --hf-checkpoint's config.json:
equal is accepted and logged, different is one error line naming both values) and
`check_run_flags` (a run flag is accepted where its value means here what it means in slime,
refused with the reason otherwise). `SHAPE_TABLE` and `RUN_TABLE` are what
docs/coming-from-slime.md's generated table says of each flag. Imports only clifields and
contracts.

Why the shape flags are checked and not used: the model here is always built from
config.json (HF weights, HF names); Megatron builds it from these flags, with Megatron's
defaults for the flags a script leaves out (LayerNorm, GeLU, biases, tied embeddings, one query
group per head, ...). So when a script describes a whole model (it gives `--num-layers`), the
defaults count too: a Qwen3 script without `--qk-layernorm` describes another model.

Worked example: `--num-layers 36` with a config.json of `num_hidden_layers: 36` is accepted
(`accepted: --num-layers 36 (config.json: num_hidden_layers 36)`); with `num_hidden_layers: 28`
the run is refused with `--num-layers 36, but /m/config.json has num_hidden_layers 28: ...`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

from clifields import add_flags, flag
from slime_async.contracts.model import ModelSpec

__all__ = [
    "RUN_TABLE",
    "SHAPE_TABLE",
    "ModelShapeFlags",
    "RunAnswer",
    "RunFacts",
    "ScriptRunFlags",
    "add_script_args",
    "check_run_flags",
    "check_shape",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelShapeFlags:
    """Megatron's model-shape flags: the model is built from --hf-checkpoint's config.json, and
    each of these given is checked against it (a mismatch is refused naming both values)."""

    num_layers: int | None = flag(None, ge=1)
    """Megatron's layer count; checked: config.json's num_hidden_layers."""
    hidden_size: int | None = flag(None, ge=1)
    """Megatron's model width; checked: config.json's hidden_size."""
    ffn_hidden_size: int | None = flag(None, ge=1)
    """Megatron's MLP width; checked: config.json's intermediate_size."""
    num_attention_heads: int | None = flag(None, ge=1)
    """Megatron's query heads; checked: config.json's num_attention_heads."""
    group_query_attention: bool | None = None
    """Megatron's grouped-query attention switch; checked with --num-query-groups against
    config.json's num_key_value_heads."""
    num_query_groups: int | None = flag(None, ge=1)
    """Megatron's key/value heads (with --group-query-attention); checked: num_key_value_heads."""
    kv_channels: int | None = flag(None, ge=1)
    """Megatron's per-head width; checked: config.json's head_dim."""
    vocab_size: int | None = flag(None, ge=1)
    """Megatron's vocabulary size (before padding); checked: config.json's vocab_size."""
    norm_epsilon: float | None = flag(None, gt=0)
    """Megatron's norm epsilon; checked: config.json's rms_norm_eps."""
    normalization: Literal["LayerNorm", "RMSNorm"] | None = None
    """Megatron's norm kind; checked: every supported model uses RMSNorm."""
    swiglu: bool | None = None
    """Megatron's SwiGLU MLP switch; checked: every supported model's MLP is SwiGLU."""
    use_rotary_position_embeddings: bool | None = None
    """Megatron's RoPE switch; checked: every supported model uses RoPE."""
    position_embedding_type: (
        Literal["learned_absolute", "rope", "mrope", "relative", "none"] | None
    ) = None
    """Megatron's position embedding; checked: rope."""
    rotary_base: float | None = flag(None, gt=0)
    """Megatron's RoPE base; checked: config.json's rope_theta."""
    rotary_percent: float | None = flag(None, gt=0, le=1)
    """Megatron's share of each head RoPE rotates; checked: 1.0 (the whole head)."""
    qk_layernorm: bool | None = None
    """Megatron's query/key norm switch; checked: on for qwen3 and qwen3_moe, off otherwise."""
    disable_bias_linear: bool | None = None
    """Megatron's no-bias switch; checked: no supported model has biases in its linear layers
    (besides qwen2's q/k/v, --add-qkv-bias)."""
    add_qkv_bias: bool | None = None
    """Megatron's q/k/v bias switch; checked: on for qwen2, off otherwise."""
    untie_embeddings_and_output_weights: bool | None = None
    """Megatron's untied output layer; checked: config.json's tie_word_embeddings is false."""
    max_position_embeddings: int | None = flag(None, ge=1)
    """Megatron's longest sequence; checked: config.json's max_position_embeddings."""
    use_rope_scaling: bool | None = None
    """Megatron's Llama 3.1 RoPE scaling switch; checked: config.json's rope_scaling (llama3,
    with Megatron's fixed low/high frequency factors 1 and 4 and original context 8192)."""
    rotary_scaling_factor: float | None = flag(None, gt=0)
    """Megatron's RoPE scaling factor (with --use-rope-scaling); checked: rope_scaling.factor."""
    num_experts: int | None = flag(None, ge=1)
    """Megatron's routed experts per MoE layer; checked: config.json's num_experts (none for a
    dense model)."""
    moe_ffn_hidden_size: int | None = flag(None, ge=1)
    """Megatron's per-expert MLP width; checked: config.json's moe_intermediate_size."""
    moe_router_topk: int | None = flag(None, ge=1)
    """Megatron's experts per token; checked: config.json's num_experts_per_tok."""
    moe_layer_freq: str | None = flag(None, metavar="N|[0/1,...]")
    """Megatron's MoE layer pattern (every Nth layer, or one 0/1 per layer); checked: every
    layer of a qwen3_moe model is MoE."""
    moe_router_score_function: Literal["softmax", "sigmoid"] | None = None
    """Megatron's router score; checked: softmax (Qwen3-MoE)."""
    moe_router_pre_softmax: bool | None = None
    """Megatron's softmax before top-k; checked: off (Qwen3-MoE renormalises the top-k
    probabilities, norm_topk_prob)."""
    moe_router_topk_scaling_factor: float | None = flag(None, gt=0)
    """Megatron's routing weight scale; checked: 1 (Qwen3-MoE does not scale)."""
    moe_shared_expert_intermediate_size: int | None = flag(None, ge=0)
    """Megatron's shared expert width; checked: 0 (no supported model has shared experts)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScriptRunFlags:
    """Run flags of slime's scripts (Megatron's and slime's) that are accepted where their value
    means here what it means in slime, and refused with the reason otherwise (the table in
    docs/coming-from-slime.md)."""

    sequence_parallel: bool | None = None
    """Megatron's sequence parallelism: on here whenever --tensor-model-parallel-size > 1
    (Megatron turns it off at TP 1)."""
    context_parallel_size: int | None = flag(None, ge=1)
    """Megatron's context parallelism: 1 only (not implemented here)."""
    expert_tensor_parallel_size: int | None = flag(None, ge=1)
    """Megatron's tensor parallelism of the experts: here the experts are split like the rest
    of the model, so it equals --tensor-model-parallel-size (any value for a dense model)."""
    optimizer: Literal["adam", "sgd"] | None = None
    """Megatron's optimizer: adam (Megatron's Adam with decoupled weight decay) only."""
    attention_dropout: float | None = flag(None, ge=0, lt=1)
    """Megatron's attention dropout: 0 only (the trainer runs without dropout)."""
    hidden_dropout: float | None = flag(None, ge=0, lt=1)
    """Megatron's hidden dropout: 0 only (the trainer runs without dropout)."""
    attention_softmax_in_fp32: bool | None = None
    """Megatron's fp32 attention softmax: always so here."""
    accumulate_allreduce_grads_in_fp32: bool | None = None
    """Megatron's fp32 gradient accumulation and reduction: always so here (fp32 gradient
    buffers, also under --bf16)."""
    attention_backend: Literal["flash", "fused", "unfused", "local", "auto"] | None = None
    """Megatron's attention kernel: a kernel choice only; the trainer runs its own attention
    on packed samples (PyTorch SDPA), the same math."""
    moe_grouped_gemm: bool | None = None
    """Megatron's grouped expert GEMM: a kernel choice only; the trainer's experts are Megatron's
    sequential expert MLPs, the same math."""
    moe_permute_fusion: bool | None = None
    """Megatron's fused token permutation: a kernel choice only, the same math."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] | None = None
    """Megatron's token dispatcher: the trainer dispatches with allgather, the same math."""
    moe_token_drop_policy: Literal["probs", "position"] | None = None
    """Megatron's token dropping policy: applies only with an expert capacity, and no token is
    dropped here."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    """Megatron's router precision: fp32 only (the router computes in fp32 here)."""
    moe_aux_loss_coeff: float | None = flag(None, ge=0)
    """Megatron's load-balancing loss weight: 0 only (there is no auxiliary loss here)."""
    optimizer_cpu_offload: bool | None = None
    """Megatron's optimizer offload to the CPU: not implemented here (refused)."""
    overlap_cpu_optimizer_d2h_h2d: bool | None = None
    """Megatron's overlap of the offloaded optimizer's copies: not implemented here (refused)."""
    use_precision_aware_optimizer: bool | None = None
    """Megatron's precision-aware optimizer: not implemented here (refused)."""
    rollout_shuffle: bool | None = None
    """slime's prompt shuffling: the prompt order is always shuffled here, by --rollout-seed."""
    balance_data: bool | None = None
    """slime's token balance across data-parallel ranks: a performance setting only; here each
    rank takes a contiguous part of the batch (the loss is the same)."""
    kl_coef: float | None = flag(None, ge=0)
    """slime's KL penalty in the reward: 0 only (the KL term is in the loss here:
    --use-kl-loss --kl-loss-coef)."""
    offload_train: bool | None = None
    """slime's offload of the trainer while the engines generate: --no-offload-train only (the
    trainer and the engines run on their own devices here)."""
    offload_rollout: bool | None = None
    """slime's offload of the engines while the trainer trains: --no-offload-rollout only."""


def add_script_args(parser: argparse.ArgumentParser) -> None:
    """The flags of slime's scripts: Megatron's model shape and the run flags (their help says
    which values are accepted)."""
    add_flags(parser, ModelShapeFlags, group="model shape (Megatron)")
    add_flags(parser, ScriptRunFlags, group="slime script flags")


# ------------------------------------------------------------------------- the model shape


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _said(a: argparse.Namespace, *dests: str) -> str:
    """The given flags among `dests`, as typed."""
    out = []
    for d in dests:
        v = getattr(a, d, None)
        if v is None:
            continue
        if isinstance(v, bool):
            out.append(_flag(d) if v else "--no-" + _flag(d)[2:])
        else:
            out.append(f"{_flag(d)} {_num(v)}")
    return " ".join(out)


def _num(v: Any) -> str:
    """A value as a user types it (1000000, not 1e+06; 1e-06 as such)."""
    if isinstance(v, float) and not isinstance(v, bool):
        return str(int(v)) if v.is_integer() and abs(v) < 1e16 else f"{v:g}"
    return str(v)


Said = tuple[Any, str]
"""(the value Megatron builds from the flags, the flags as the message says them)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Shape:
    """One quantity of the model that Megatron's flags fix."""

    megatron: Callable[[argparse.Namespace, bool], Said | None]
    """(value, said) from the flags (the bool: the flags describe a whole model, so Megatron's
    defaults count), or None when the flags leave it open."""
    model: Said
    """(the model's value, how config.json says it)."""


def _given(dest: str, default: Any = None, *, what: str = "") -> Callable[..., Said | None]:
    """A quantity one value flag sets; with a whole model described and the flag left out,
    Megatron's `default` (None: not checked then)."""

    def f(a: argparse.Namespace, whole: bool) -> Said | None:
        v = getattr(a, dest)
        if v is not None:
            return v, _said(a, dest)
        if whole and default is not None:
            return default, f"no {_flag(dest)} (Megatron's default: {what or default})"
        return None

    return f


def _switch(dest: str, off: str, *, on: Any = True, default: Any = False) -> Callable[..., Any]:
    """A quantity a switch sets (`on` when given, Megatron's `default` when left out of a whole
    model; `off` says what that default is)."""

    def f(a: argparse.Namespace, whole: bool) -> Said | None:
        v = getattr(a, dest)
        if v is not None:
            return (on if v else default), _said(a, dest)
        return (default, f"no {_flag(dest)} (Megatron: {off})") if whole else None

    return f


def _query_groups(a: argparse.Namespace, whole: bool) -> Said | None:
    heads, groups = a.num_attention_heads, a.num_query_groups
    if a.group_query_attention:
        if groups is None:
            return 1, "--group-query-attention without --num-query-groups (Megatron's default: 1)"
        return groups, _said(a, "group_query_attention", "num_query_groups")
    if heads is None or (groups is None and not whole):
        return None
    why = (
        f"--num-query-groups {groups} without --group-query-attention, which Megatron ignores"
        if groups is not None
        else "no --group-query-attention"
    )
    return heads, f"{why} (one query group per head: {heads})"


def _kv_channels(a: argparse.Namespace, whole: bool) -> Said | None:
    if a.kv_channels is not None:
        return a.kv_channels, _said(a, "kv_channels")
    if whole and a.hidden_size and a.num_attention_heads:
        v = a.hidden_size // a.num_attention_heads
        return v, f"no --kv-channels (Megatron: --hidden-size / --num-attention-heads = {v})"
    return None


def _ffn(a: argparse.Namespace, whole: bool) -> Said | None:
    if a.ffn_hidden_size is not None or not whole or not a.hidden_size:
        return _given("ffn_hidden_size")(a, whole)
    v = 4 * a.hidden_size
    if a.swiglu:  # Megatron's SwiGLU default keeps the parameter count, rounded to 64
        v = int(v * 2 / 3 / 64) * 64
    return v, f"no --ffn-hidden-size (Megatron's default from --hidden-size: {v})"


def _position(a: argparse.Namespace, whole: bool) -> Said | None:
    if a.use_rotary_position_embeddings:
        return "rope", _said(a, "use_rotary_position_embeddings")
    if a.position_embedding_type is not None:
        return a.position_embedding_type, _said(a, "position_embedding_type")
    return ("learned_absolute", "no RoPE flag (Megatron: learned_absolute)") if whole else None


def _qkv_bias(a: argparse.Namespace, whole: bool) -> Said | None:
    if a.add_qkv_bias is not None:
        on = a.add_qkv_bias or not a.disable_bias_linear
        return on, _said(a, "add_qkv_bias")
    if a.disable_bias_linear is None and not whole:
        return None
    on = not a.disable_bias_linear
    said = "no --add-qkv-bias" if a.disable_bias_linear else "no --disable-bias-linear"
    return on, f"{said} (Megatron: q/k/v biases {'on' if on else 'off'})"


_MEGATRON_ROPE_SCALING = (1.0, 4.0, 8192)
"""Megatron's fixed llama3 scaling: low and high frequency factors, original context."""


def _rope_scaling(a: argparse.Namespace, whole: bool) -> Said | None:
    if a.use_rope_scaling:
        factor = 8.0 if a.rotary_scaling_factor is None else a.rotary_scaling_factor
        said = _said(a, "use_rope_scaling", "rotary_scaling_factor")
        low, high, ctx = _MEGATRON_ROPE_SCALING
        return ("llama3", factor, low, high, ctx), (
            f"{said} (Megatron: llama3 scaling, factor {factor:g}, low/high frequency factors "
            f"{low:g}/{high:g}, original context {ctx})"
        )
    if a.use_rope_scaling is None and a.rotary_scaling_factor is None and not whole:
        return None
    return None, (_said(a, "use_rope_scaling", "rotary_scaling_factor") or "no --use-rope-scaling")


def _model_rope_scaling(m: ModelSpec) -> Said:
    if m.rope_scaling is None:
        return None, "no rope_scaling"
    v = (
        m.rope_scaling,
        m.rope_factor,
        m.rope_low_freq_factor,
        m.rope_high_freq_factor,
        m.rope_original_max_position_embeddings,
    )
    return v, (
        f"rope_scaling llama3 (factor {v[1]:g}, low/high_freq_factor {v[2]:g}/{v[3]:g}, "
        f"original_max_position_embeddings {v[4]})"
    )


def _experts(a: argparse.Namespace, whole: bool) -> Said | None:
    if a.num_experts is not None:
        return a.num_experts, _said(a, "num_experts")
    return (None, "no --num-experts (a dense MLP)") if whole else None


def _moe_default(dest: str, default: Callable[[argparse.Namespace], Any], what: str) -> Any:
    """An MoE quantity: its flag, else Megatron's default once --num-experts is given."""

    def f(a: argparse.Namespace, whole: bool) -> Said | None:
        v = getattr(a, dest)
        if v is not None:
            return v, _said(a, dest)
        if a.num_experts is not None:
            d = default(a)
            return d, f"no {_flag(dest)} (Megatron's default: {what} {d})"
        return None

    return f


def moe_layers_of(freq: str, num_layers: int) -> list[int]:
    """The MoE layers of Megatron's `--moe-layer-freq`: an integer N (every Nth layer, from
    layer 0) or a list of one 0/1 per layer. Raises ValueError for anything else."""
    try:
        v = ast.literal_eval(freq.strip())
    except (ValueError, SyntaxError):
        v = None
    if isinstance(v, int) and v >= 1:
        return [i for i in range(num_layers) if i % v == 0]
    if isinstance(v, list) and all(x in (0, 1) for x in v):
        if len(v) != num_layers:
            raise ValueError(
                f"--moe-layer-freq lists {len(v)} layers, but the model has {num_layers}"
            )
        return [i for i, x in enumerate(v) if x]
    raise ValueError(
        f"--moe-layer-freq {freq}: give an integer N (every Nth layer) or a list of one 0/1 "
        "per layer, e.g. [1,1,1]"
    )


def _moe_layers(m: ModelSpec) -> Callable[..., Said | None]:
    def f(a: argparse.Namespace, whole: bool) -> Said | None:
        if a.moe_layer_freq is None and a.num_experts is None:
            return None
        layers = m.num_layers if a.num_layers is None else a.num_layers
        moe = moe_layers_of(a.moe_layer_freq or "1", layers)
        said = _said(a, "moe_layer_freq") or "no --moe-layer-freq (Megatron's default: 1)"
        return moe, f"{said} (MoE layers: {_span(moe, layers)})"

    return f


def _span(layers: list[int], n: int) -> str:
    if layers == list(range(n)):
        return f"all {n}"
    return str(layers) if layers else "none"


def _moe(m: ModelSpec, value: Any, text: str) -> Said:
    return (value, text) if m.is_moe else (None, f"no experts (a dense {m.family} model)")


def _hf(value: Any, name: str) -> Said:
    return value, f"{name} {_num(value)}"


def _model_side(m: ModelSpec) -> dict[str, Said]:
    """The model's value of each quantity, as config.json says it."""
    fam, moe_layers = m.family, m.moe_layers()
    no = {True: "", False: "no "}
    return {
        "layers": _hf(m.num_layers, "num_hidden_layers"),
        "hidden": _hf(m.hidden_size, "hidden_size"),
        "ffn": _hf(m.intermediate_size, "intermediate_size"),
        "heads": _hf(m.num_attention_heads, "num_attention_heads"),
        "groups": _hf(m.num_key_value_heads, "num_key_value_heads"),
        "head_dim": _hf(m.head_dim, "head_dim"),
        "vocab": _hf(m.vocab_size, "vocab_size"),
        "eps": _hf(m.rms_norm_eps, "rms_norm_eps"),
        "norm": ("RMSNorm", "RMSNorm norms"),
        "swiglu": (True, "a SwiGLU MLP (silu)"),
        "position": ("rope", "RoPE"),
        "rope_base": _hf(m.rope_theta, "rope_theta"),
        "rope_percent": (1.0, "RoPE over the whole head"),
        "qk_norm": (m.qk_norm, f"{no[m.qk_norm]}query/key RMSNorm ({fam})"),
        "bias": (False, "no biases in the linear layers"),
        "qkv_bias": (m.qkv_bias, f"{no[m.qkv_bias]}q/k/v biases ({fam})"),
        "untie": (
            not m.tie_word_embeddings,
            f"tie_word_embeddings {str(m.tie_word_embeddings).lower()}",
        ),
        "max_pos": _hf(m.max_position_embeddings, "max_position_embeddings"),
        "rope_scaling": _model_rope_scaling(m),
        "experts": _moe(m, m.num_experts, f"num_experts {m.num_experts}"),
        "topk": _moe(m, m.moe_topk, f"num_experts_per_tok {m.moe_topk}"),
        "moe_ffn": _moe(
            m, m.moe_intermediate_size, f"moe_intermediate_size {m.moe_intermediate_size}"
        ),
        "moe_layers": _moe(m, moe_layers, f"MoE layers: {_span(moe_layers, m.num_layers)}"),
        "score": _moe(m, "softmax", "softmax routing (qwen3_moe)"),
        "pre_softmax": _moe(m, False, "top-k probabilities renormalised (norm_topk_prob)"),
        "topk_scale": _moe(m, 1.0, "routing weights unscaled"),
        "shared": (0, "no shared experts"),
    }


_BIAS_OFF = "biases in every linear layer"
_FLAG_SIDE: dict[str, Callable[..., Any]] = {
    "layers": _given("num_layers"),
    "hidden": _given("hidden_size"),
    "ffn": _ffn,
    "heads": _given("num_attention_heads"),
    "groups": _query_groups,
    "head_dim": _kv_channels,
    "vocab": _given("vocab_size"),
    "eps": _given("norm_epsilon", 1e-5),
    "norm": _given("normalization", "LayerNorm"),
    "swiglu": _switch("swiglu", "a GeLU MLP"),
    "position": _position,
    "rope_base": _given("rotary_base", 10000.0),
    "rope_percent": _given("rotary_percent", 1.0),
    "qk_norm": _switch("qk_layernorm", "no query/key norm"),
    "bias": _switch("disable_bias_linear", _BIAS_OFF, on=False, default=True),
    "qkv_bias": _qkv_bias,
    "untie": _switch(
        "untie_embeddings_and_output_weights", "the output layer tied to the embedding"
    ),
    "max_pos": _given("max_position_embeddings"),
    "rope_scaling": _rope_scaling,
    "experts": _experts,
    "topk": _moe_default("moe_router_topk", lambda a: 2, ""),
    "moe_ffn": _moe_default(
        "moe_ffn_hidden_size", lambda a: a.ffn_hidden_size, "--ffn-hidden-size"
    ),
    "moe_layers": None,  # needs the model's layer count: `_moe_layers`
    "score": _given("moe_router_score_function"),
    "pre_softmax": lambda a, whole: _switch("moe_router_pre_softmax", "top-k first")(
        a, whole and a.num_experts is not None
    ),
    "topk_scale": _given("moe_router_topk_scaling_factor"),
    "shared": _given("moe_shared_expert_intermediate_size"),
}
"""Each quantity -> how Megatron's flags fix it (`_Shape.megatron`)."""


def _shapes(m: ModelSpec) -> list[_Shape]:
    """Every quantity Megatron's flags fix, with the model's value."""
    model = _model_side(m)
    return [
        _Shape(_moe_layers(m) if fn is None else fn, model[name]) for name, fn in _FLAG_SIDE.items()
    ]


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
        return not isinstance(y, bool) and math.isclose(x, y, rel_tol=1e-9, abs_tol=0.0)
    return x == y


def check_shape(
    a: argparse.Namespace, model: ModelSpec, *, where: str
) -> tuple[dict[str, str], list[str]]:
    """Each quantity the given shape flags fix, against `model` (`where` names its
    config.json): ({flags as typed: what config.json says}, [one error line per mismatch]).
    Flags that describe a whole model (`--num-layers` given) are held to Megatron's defaults
    for the switches they leave out."""
    whole = a.num_layers is not None
    accepted: dict[str, str] = {}
    errors: list[str] = []
    for shape in _shapes(model):
        try:
            got = shape.megatron(a, whole)
        except ValueError as e:
            errors.append(str(e))
            continue
        if got is None:
            continue
        value, said = got
        want, has = shape.model
        if _same(value, want):
            if not said.startswith("no "):  # a default that holds: nothing given to log
                accepted[said] = f"{where}: {has}"
        else:
            errors.append(
                f"{said}, but {where} has {has}: the model is built from config.json; "
                "fix the flag to match it (or drop the flag)"
            )
    return accepted, errors


# ------------------------------------------------------------------------- the run flags


@dataclasses.dataclass(frozen=True, slots=True)
class RunFacts:
    """What a run flag's answer depends on."""

    tp: int
    """--tensor-model-parallel-size."""
    moe: bool
    """The model has routed experts."""


Verdict = Callable[[Any, RunFacts], str | None]
"""A given value -> None (accepted) or why it is refused."""


def _only(*ok: Any, why: str) -> Verdict:
    return lambda v, _f: None if any(_same(v, o) for o in ok) else why


def _etp(v: Any, f: RunFacts) -> str | None:
    if not f.moe or v == f.tp:
        return None
    return (
        f"here the experts are split by tensor parallelism like the rest of the model, so "
        f"--expert-tensor-parallel-size is --tensor-model-parallel-size ({f.tp}) and "
        "--expert-model-parallel-size must divide the data-parallel size; give "
        f"--expert-tensor-parallel-size {f.tp} (or drop it) and an expert-parallel size that "
        "divides ranks / (TP x PP)"
    )


def _sp(v: Any, f: RunFacts) -> str | None:
    if v or f.tp == 1:
        return None
    return "sequence parallelism is always on with tensor parallelism here; drop --no-sequence-parallel"


_OFFLOAD_OPT = (
    "Megatron's CPU offload of the optimizer is not implemented here: the optimizer state "
    "stays with the trainer ranks (sharded over data-parallel ranks with "
    "--use-distributed-optimizer, the default with DP > 1); drop the flag"
)
_NO_OFFLOAD = (
    "slime time-shares the GPUs between trainer and engines; here they run on their own "
    "devices, so there is nothing to offload"
)


@dataclasses.dataclass(frozen=True, slots=True)
class RunAnswer:
    """What a run flag of slime's scripts gets here."""

    accepts: str
    """The values accepted ("" when none is)."""
    here: str
    """What an accepted value means here (the `accepted:` line), or why none is."""
    verdict: Verdict
    """A given value -> None (accepted) or why it is refused."""


def _any(_v: Any, _f: RunFacts) -> str | None:
    return None


_NO_DROPOUT = "the trainer runs without dropout (its log-probs are the policy's)"
RUN_TABLE: dict[str, RunAnswer] = {
    "sequence_parallel": RunAnswer(
        "on", "sequence parallelism is on whenever --tensor-model-parallel-size > 1", _sp
    ),
    "context_parallel_size": RunAnswer(
        "1",
        "no context parallelism: it is not implemented here (long samples: "
        "--recompute-granularity, --use-dynamic-batch-size --max-tokens-per-gpu)",
        _only(1, why="context parallelism is not implemented here; give 1 (or drop it)"),
    ),
    "expert_tensor_parallel_size": RunAnswer(
        "--tensor-model-parallel-size's value; any for a dense model",
        "the experts are split by tensor parallelism like the rest of the model (a dense "
        "model has none)",
        _etp,
    ),
    "optimizer": RunAnswer(
        "adam",
        "Megatron's Adam with decoupled weight decay (--adam-beta1/2, --adam-eps)",
        _only("adam", why="the trainer's optimizer is Megatron's Adam; give adam"),
    ),
    "attention_dropout": RunAnswer("0", _NO_DROPOUT, _only(0.0, why=_NO_DROPOUT)),
    "hidden_dropout": RunAnswer("0", _NO_DROPOUT, _only(0.0, why=_NO_DROPOUT)),
    "attention_softmax_in_fp32": RunAnswer(
        "on",
        "the attention softmax is always fp32 here",
        _only(True, why="the attention softmax is always fp32 here"),
    ),
    "accumulate_allreduce_grads_in_fp32": RunAnswer(
        "on",
        "gradients are always accumulated and reduced in fp32 here (also under --bf16)",
        _only(True, why="gradients are always accumulated and reduced in fp32 here"),
    ),
    "attention_backend": RunAnswer(
        "any",
        "a kernel choice: the trainer runs its own attention on packed samples (PyTorch SDPA), "
        "the same math",
        _any,
    ),
    "moe_grouped_gemm": RunAnswer(
        "any", "a kernel choice: Megatron's sequential expert MLPs, the same math", _any
    ),
    "moe_permute_fusion": RunAnswer("any", "a kernel choice: the same math unfused", _any),
    "moe_token_dispatcher_type": RunAnswer(
        "any", "a communication choice: the trainer dispatches with allgather, the same math", _any
    ),
    "moe_token_drop_policy": RunAnswer(
        "any", "applies only with an expert capacity: no token is dropped here", _any
    ),
    "moe_router_dtype": RunAnswer(
        "fp32",
        "the router computes in fp32",
        _only("fp32", why="the router computes in fp32 here; give fp32"),
    ),
    "moe_aux_loss_coeff": RunAnswer(
        "0",
        "there is no load-balancing loss here",
        _only(0.0, why="there is no load-balancing loss here; give 0 (or drop it)"),
    ),
    "optimizer_cpu_offload": RunAnswer("", _OFFLOAD_OPT, _only(False, why=_OFFLOAD_OPT)),
    "overlap_cpu_optimizer_d2h_h2d": RunAnswer("", _OFFLOAD_OPT, _only(False, why=_OFFLOAD_OPT)),
    "use_precision_aware_optimizer": RunAnswer(
        "",
        "Megatron's precision-aware optimizer is not implemented here (fp32 main weights and Adam "
        "moments; --bf16 computes in bf16); drop the flag",
        _only(False, why="Megatron's precision-aware optimizer is not implemented here; drop it"),
    ),
    "rollout_shuffle": RunAnswer(
        "on",
        "the prompt order is always shuffled here, by --rollout-seed",
        _only(True, why="the prompt order is always shuffled here (by --rollout-seed)"),
    ),
    "balance_data": RunAnswer(
        "any",
        "a performance setting only: each data-parallel rank takes a contiguous part of the "
        "batch (the loss is the same)",
        _any,
    ),
    "kl_coef": RunAnswer(
        "0",
        "no KL penalty in the reward: the KL term is in the loss here (--use-kl-loss "
        "--kl-loss-coef C --kl-loss-type)",
        _only(
            0.0,
            why="slime's KL penalty in the reward is not here; the KL term is in the loss: "
            "--use-kl-loss --kl-loss-coef C --kl-loss-type",
        ),
    ),
    "offload_train": RunAnswer("off", _NO_OFFLOAD, _only(False, why=_NO_OFFLOAD)),
    "offload_rollout": RunAnswer("off", _NO_OFFLOAD, _only(False, why=_NO_OFFLOAD)),
}
"""Run flag (dest) -> its answer (the table in docs/coming-from-slime.md, and the check)."""

SHAPE_TABLE: str = (
    "checked against the model's config.json (--hf-checkpoint): equal is accepted and logged, "
    "different is refused naming both values; a script that gives --num-layers describes a "
    "whole model, so the switches it leaves out count as Megatron's defaults"
)
"""What the table says of every `ModelShapeFlags` flag."""


def check_run_flags(a: argparse.Namespace, facts: RunFacts) -> tuple[dict[str, str], list[str]]:
    """Each given run flag of `RUN_TABLE`: ({flag as typed: what it means here}, [why each
    refused one is refused])."""
    accepted: dict[str, str] = {}
    errors: list[str] = []
    for dest, answer in RUN_TABLE.items():
        v = getattr(a, dest, None)
        if v is None:
            continue
        said = _said(a, dest)
        why = answer.verdict(v, facts)
        if why is None:
            accepted[said] = answer.here
        else:
            errors.append(f"{said} (a flag of slime's scripts): {why}")
    return accepted, errors
