"""Megatron's model-shape flags as slime's launch scripts pass them (`scripts/models/<model>.sh`
in slime): read and checked against the model the run trains, which is always built from
--hf-checkpoint's config.json.

Owns `ModelShapeFlags` (`--num-layers`, `--hidden-size`, `--num-query-groups`, `--qk-layernorm`,
`--num-experts`, ...: one field each), `check_shape` (each given flag against the `ModelSpec`:
equal is accepted and logged, different is one error line naming both values), `SHAPE_TABLE`
(what docs/coming-from-slime.md's generated table says of them), and the helpers the run flags
share (`as_typed`, `same`). Imports only clifields and contracts.

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

from clifields import flag
from slime_async.contracts.model import ModelSpec

__all__ = ["SHAPE_TABLE", "ModelShapeFlags", "as_typed", "check_shape", "moe_layers_of", "same"]


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


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def as_typed(a: argparse.Namespace, *dests: str) -> str:
    """The given flags among `dests`, as a user types them."""
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
            return v, as_typed(a, dest)
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
            return (on if v else default), as_typed(a, dest)
        return (default, f"no {_flag(dest)} (Megatron: {off})") if whole else None

    return f


def _query_groups(a: argparse.Namespace, whole: bool) -> Said | None:
    heads, groups = a.num_attention_heads, a.num_query_groups
    if a.group_query_attention:
        if groups is None:
            return 1, "--group-query-attention without --num-query-groups (Megatron's default: 1)"
        return groups, as_typed(a, "group_query_attention", "num_query_groups")
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
        return a.kv_channels, as_typed(a, "kv_channels")
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
        return "rope", as_typed(a, "use_rotary_position_embeddings")
    if a.position_embedding_type is not None:
        return a.position_embedding_type, as_typed(a, "position_embedding_type")
    return ("learned_absolute", "no RoPE flag (Megatron: learned_absolute)") if whole else None


def _qkv_bias(a: argparse.Namespace, whole: bool) -> Said | None:
    if a.add_qkv_bias is not None:
        on = a.add_qkv_bias or not a.disable_bias_linear
        return on, as_typed(a, "add_qkv_bias")
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
        said = as_typed(a, "use_rope_scaling", "rotary_scaling_factor")
        low, high, ctx = _MEGATRON_ROPE_SCALING
        return ("llama3", factor, low, high, ctx), (
            f"{said} (Megatron: llama3 scaling, factor {factor:g}, low/high frequency factors "
            f"{low:g}/{high:g}, original context {ctx})"
        )
    if a.use_rope_scaling is None and a.rotary_scaling_factor is None and not whole:
        return None
    return None, (
        as_typed(a, "use_rope_scaling", "rotary_scaling_factor") or "no --use-rope-scaling"
    )


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
        return a.num_experts, as_typed(a, "num_experts")
    return (None, "no --num-experts (a dense MLP)") if whole else None


def _moe_default(dest: str, default: Callable[[argparse.Namespace], Any], what: str) -> Any:
    """An MoE quantity: its flag, else Megatron's default once --num-experts is given."""

    def f(a: argparse.Namespace, whole: bool) -> Said | None:
        v = getattr(a, dest)
        if v is not None:
            return v, as_typed(a, dest)
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
        said = as_typed(a, "moe_layer_freq") or "no --moe-layer-freq (Megatron's default: 1)"
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


def same(x: Any, y: Any) -> bool:
    """Equal values; numbers within a relative 1e-9 (1e-06 typed against 1e-6 read)."""
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
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
        if same(value, want):
            if not said.startswith("no "):  # a default that holds: nothing given to log
                accepted[said] = f"{where}: {has}"
        else:
            errors.append(
                f"{said}, but {where} has {has}: the model is built from config.json; "
                "fix the flag to match it (or drop the flag)"
            )
    return accepted, errors


SHAPE_TABLE: str = (
    "checked against the model's config.json (--hf-checkpoint): equal is accepted and logged, "
    "different is refused naming both values; a script that gives --num-layers describes a "
    "whole model, so the switches it leaves out count as Megatron's defaults"
)
"""What the table says of every `ModelShapeFlags` flag."""
