"""The vision-language side of a `ModelSpec`'s HF conversion (kept apart from `model.py`).

Owns: `check_vl` (a spec's VL fields are set exactly for the VL family and fit its shape),
`vl_hf_config` (the `Qwen2_5_VLConfig` of a spec: the language model's fields as `text_config`
with mRoPE in `rope_parameters`, the vision encoder's, the image token ids) and `text_fields`
(a VL config's language-model fields as one flat dict, from a published flat `config.json` or
transformers 5's nested one). Imports nothing from slime_async but `contracts.vision`.
"""

from __future__ import annotations

from typing import Any

from slime_async.contracts.vision import VisionSpec


def check_vl(
    family: str,
    vision: VisionSpec | None,
    mrope_section: tuple[int, ...] | None,
    head_dim: int,
    hidden_size: int,
) -> None:
    """ValueError when the VL fields do not fit: set exactly for `qwen2_5_vl`, the mRoPE
    sections covering head_dim / 2, the merger's output as wide as the language model."""
    vl = family == "qwen2_5_vl"
    if vl != (vision is not None) or vl != (mrope_section is not None):
        raise ValueError(
            f"vision and mrope_section are set exactly for the qwen2_5_vl family (family {family!r})"
        )
    if vision is None or mrope_section is None:
        return
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
    """`Qwen2_5_VLConfig` from the text fields `common` (`ModelSpec.to_hf_config`'s)."""
    import transformers

    assert vision is not None and mrope_section is not None
    skip = ("architectures", "tie_word_embeddings", "rope_theta", "head_dim")
    text = {k: v for k, v in common.items() if k not in skip}
    text["rope_parameters"] = {
        "rope_type": "default",
        "mrope_section": list(mrope_section),
        "rope_theta": rope_theta,
    }
    text["tie_word_embeddings"] = tie
    vision_cfg, ids = vision.to_hf()
    return transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision_cfg,
        tie_word_embeddings=tie,
        architectures=[architecture],
        **ids,
    )


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
