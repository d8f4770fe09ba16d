"""The vision-language side of a `ModelSpec`'s HF conversion (kept apart from `model.py`).

Owns: `check_vl` (a spec's VL fields are set exactly for the VL families and fit its shape),
`vl_hf_config` (the `Qwen2_5_VLConfig` or `Qwen3VLConfig` of a spec: the language model's
fields as `text_config` with mRoPE in `rope_parameters`, the vision encoder's, the image token
ids), `vl_fields` (the VL fields of a spec read from an HF config, with the checks the trainer
needs) and `text_fields` (a VL config's language-model fields as one flat dict, from a
published flat `config.json` or transformers 5's nested one). Imports nothing from slime_async
but `contracts.vision_spec`.
"""

from __future__ import annotations

from typing import Any

from slime_async.contracts.vision_spec import VL_FAMILIES, VisionSpec


def check_vl(
    family: str,
    vision: VisionSpec | None,
    mrope_section: tuple[int, ...] | None,
    head_dim: int,
    hidden_size: int,
) -> None:
    """ValueError when the VL fields do not fit: set exactly for the VL families (the encoder
    of the family's kind), the mRoPE sections covering head_dim / 2, the merger's output as wide
    as the language model."""
    vl = family in VL_FAMILIES
    if vl != (vision is not None) or vl != (mrope_section is not None):
        raise ValueError(
            f"vision and mrope_section are set exactly for the {'/'.join(VL_FAMILIES)} families "
            f"(family {family!r})"
        )
    if vision is None or mrope_section is None:
        return
    if vision.encoder != family:
        raise ValueError(f"a {family} model needs its own vision encoder, not {vision.encoder}")
    if sum(mrope_section) != head_dim // 2:
        raise ValueError(
            f"mrope_section {list(mrope_section)} must sum to head_dim / 2 ({head_dim // 2})"
        )
    if vision.out_hidden_size != hidden_size:
        raise ValueError(
            f"vision out_hidden_size ({vision.out_hidden_size}) must equal the language "
            f"model's hidden_size ({hidden_size})"
        )


def vl_hf_config(
    common: dict[str, Any],
    *,
    mrope_section: tuple[int, ...] | None,
    rope_theta: float,
    tie: bool,
    vision: VisionSpec | None,
    architecture: str,
) -> Any:
    """`Qwen2_5_VLConfig` / `Qwen3VLConfig` from the text fields `common`
    (`ModelSpec.to_hf_config`'s)."""
    import transformers

    assert vision is not None and mrope_section is not None
    skip = ("architectures", "tie_word_embeddings", "rope_theta")
    skip += ("use_sliding_window", "sliding_window") if vision.qwen3 else ("head_dim",)
    text = {k: v for k, v in common.items() if k not in skip}
    text["rope_parameters"] = {
        "rope_type": "default",
        "mrope_section": list(mrope_section),
        "rope_theta": rope_theta,
    }
    if vision.qwen3:
        text["rope_parameters"]["mrope_interleaved"] = True
    text["tie_word_embeddings"] = tie
    vision_cfg, ids = vision.to_hf()
    cls = transformers.Qwen3VLConfig if vision.qwen3 else transformers.Qwen2_5_VLConfig
    return cls(
        text_config=text,
        vision_config=vision_cfg,
        tie_word_embeddings=tie,
        architectures=[architecture],
        **ids,
    )


def vl_fields(top: dict[str, Any], d: dict[str, Any], rp: dict[str, Any]) -> dict[str, Any]:
    """The `ModelSpec` fields of a VL config (`top`; `d` its flat text fields, `rp` their rope
    parameters): `mrope_section` and `vision`. ValueError for what the trainer does not run."""
    mtype = top["model_type"]
    heads = d["num_attention_heads"]
    if (
        mtype == "qwen2_5_vl"
        and (d.get("head_dim") or d["hidden_size"] // heads) * heads != (d["hidden_size"])
    ):
        raise ValueError("qwen2_5_vl config field head_dim must be hidden_size / heads")
    section = rp.get("mrope_section")
    if not section:
        raise ValueError(f"{mtype} config has no rope_scaling.mrope_section")
    if mtype == "qwen3_vl" and not rp.get("mrope_interleaved"):
        raise ValueError(
            "qwen3_vl config field rope_scaling.mrope_interleaved=False is not supported: "
            "Qwen3-VL's multimodal RoPE interleaves the temporal, height and width frequencies"
        )
    return dict(mrope_section=tuple(section), vision=VisionSpec.from_hf(top))


def text_fields(top: dict[str, Any]) -> dict[str, Any]:
    """A VL config's language-model fields: a published (flat) config.json keeps them at the
    top, transformers 5 nests them in `text_config`; either way one flat dict."""
    nested = top.get("text_config") or {}
    text = {**top, **nested}
    text["model_type"] = top["model_type"]
    text["tie_word_embeddings"] = bool(
        top.get("tie_word_embeddings") or nested.get("tie_word_embeddings")
    )
    return text
