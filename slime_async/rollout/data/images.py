"""Images in prompt data: `--multimodal-keys` rows to prompts with image placeholders.

Owns: `VisionData` (a vision-language checkpoint's vision spec, its image processor and the
placeholder text its tokenizer renders), `vision_data` (read from `--hf-checkpoint`, None for a
text model), `row_images` (a row's image references: a path, base64 or a data URI, or a list),
`with_placeholders` (each `<image>` marker of a prompt, or the prompt's front, gets an image's
placeholder) and `expand` (the tokenized prompt's pads expanded to each image's grid, the
processor run once per row). A prompt carries its images as references in its payload
(`images`); pixels are made where they are used (the engine, the trainer), never shipped.
Never imports the trainer, engine or controller.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slime_async.contracts.vision import (
    VisionSpec,
    expand_image_pads,
    image_processor,
    preprocess,
    read_image,
)

MARKER = "<image>"
"""Where an image goes in a prompt's text (else the images go in front of it)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VisionData:
    vision: VisionSpec
    processor: Any
    placeholder: str
    """`<|vision_start|><|image_pad|><|vision_end|>` as the tokenizer writes it."""


def vision_data(hf_checkpoint: str | None, tokenizer: Any) -> VisionData | None:
    """The vision side of `hf_checkpoint`'s model, or None for a text model."""
    if hf_checkpoint is None:
        return None
    from transformers import AutoConfig

    from slime_async.contracts.model import ModelSpec

    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(hf_checkpoint))
    if spec.vision is None:
        return None
    v = spec.vision
    ids = [v.vision_start_token_id, v.image_token_id, v.vision_end_token_id]
    return VisionData(
        vision=v,
        processor=image_processor(hf_checkpoint, v),
        placeholder=tokenizer.decode(ids, skip_special_tokens=False),
    )


def row_images(rec: dict[str, Any], key: str) -> tuple[str, ...]:
    """The image references of a row's `key` field (none when it is missing or null)."""
    refs = rec.get(key)
    if refs is None:
        return ()
    refs = [refs] if isinstance(refs, str) else refs
    if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
        raise ValueError(f"{key!r} must be an image path / base64 string or a list of them")
    return tuple(refs)


def with_placeholders(prompt: Any, n: int, placeholder: str) -> Any:
    """`prompt` (a string or chat messages) with `n` image placeholders: at its `<image>`
    markers (their count must be `n`), else in front of the (first user message's) text."""
    if n == 0:
        return prompt
    if isinstance(prompt, str):
        return _place(prompt, n, placeholder)
    out, placed = [], False
    marked = sum(str(m.get("content", "")).count(MARKER) for m in prompt)
    for m in prompt:
        text = m.get("content")
        if not isinstance(text, str):
            out.append(m)
            continue
        here = MARKER in text if marked else (not placed and m.get("role") == "user")
        if here:
            k = text.count(MARKER) if marked else n
            m, placed = {**m, "content": _place(text, k, placeholder)}, True
        out.append(m)
    if not placed:
        raise ValueError("no user message to put the images in")
    return out


def _place(text: str, n: int, placeholder: str) -> str:
    marks = text.count(MARKER)
    if marks == 0:
        return placeholder * n + text
    if marks != n:
        raise ValueError(f"the prompt has {marks} {MARKER} markers for {n} images")
    return text.replace(MARKER, placeholder)


def expand(ids: list[int], refs: tuple[str, ...], data: VisionData) -> list[int]:
    """Prompt ids with each image's single pad expanded to its grid (the processor run once)."""
    images = preprocess(data.processor, [read_image(r)[0] for r in refs])
    return expand_image_pads(ids, list(images.grids), data.vision)
