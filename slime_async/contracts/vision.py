"""The vision side of a vision-language model, shared by the trainer, the engine and the data path.

Owns: `refuse_modalities` (the one-line refusal of model types and data keys this repository
does not run: video, audio, omni models), `mrope_positions` (the three position ids, temporal /
row / column, of one token row: text tokens count up on all three, an image's placeholders sit
on its merged patch grid starting where the image begins, the text after it resumes past the
larger grid side; pure; the trainer and the engine both use it), `image_processor` (the one
preprocessing of an image, which the data path and the engine share, so both count the same
placeholders), and `SampleImages` (one sample's preprocessed images as the trainer reads
them), `ImageRefs` (the same by reference: paths or base64, what crosses Ray), `read_image` /
`data_uri` (a reference's bytes) and `expand_image_pads` (one pad per image → its grid's
count). The encoder's shape, `VisionSpec`, is `contracts.vision_spec`'s (re-exported here).
Imports nothing from the rest of slime_async.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from slime_async.contracts.vision_spec import VL_FAMILIES, VisionSpec

_OTHER_MODALITIES = {
    "qwen2_audio": "audio",
    "qwen2_5_omni": "audio and video",
    "qwen2_5_omni_thinker": "audio and video",
    "qwen3_omni_moe": "audio and video",
    "qwen3_omni_moe_thinker": "audio and video",
    "qwen3_vl_moe": "a mixture-of-experts Qwen3-VL language model",
    "qwen2_vl": "the Qwen2-VL vision encoder",
    "whisper": "audio",
    "llava": "the LLaVA vision encoder",
}
"""Multimodal model types that are refused at parse time, and what they would need."""

IMAGE_KEYS: tuple[str, ...] = ("image", "images")
"""`--multimodal-keys` modalities the data path carries (everything else is refused)."""


def mrope_positions(
    ids: list[int],
    grids: list[tuple[int, int, int]],
    vision: VisionSpec,
    *,
    is_image: list[bool] | None = None,
) -> tuple[torch.Tensor, int]:
    """(`[3, T]` int64 positions of the token row `ids`, the rope delta: the next position
    minus T, which every later token, e.g. each decoded one, adds to its index).

    Raises ValueError when the placeholders do not match `grids` (one run of
    `vision.image_tokens(grid)` image tokens per image, in order). `is_image`: which tokens are
    placeholders (default: every image token id; the trainer excludes sampled ones)."""
    m = vision.spatial_merge_size
    img = is_image if is_image is not None else [t == vision.image_token_id for t in ids]
    out = torch.empty(3, len(ids), dtype=torch.long)
    pending = list(grids)
    i, cur = 0, 0
    while i < len(ids):
        if not img[i]:
            out[:, i] = cur
            i, cur = i + 1, cur + 1
            continue
        if not pending:
            raise ValueError(f"image placeholder at token {i} has no image (more placeholders)")
        t, h, w = pending.pop(0)
        if t != 1:
            raise ValueError("a grid with t > 1 is a video; only images are supported")
        gh, gw = h // m, w // m
        n = gh * gw
        if img[i : i + n] != [True] * n:
            raise ValueError(
                f"image at token {i} needs {n} placeholder tokens for its {h}x{w} patch grid"
            )
        rows = torch.arange(gh)[:, None].expand(gh, gw).flatten()
        cols = torch.arange(gw)[None, :].expand(gh, gw).flatten()
        out[0, i : i + n] = cur
        out[1, i : i + n] = cur + rows
        out[2, i : i + n] = cur + cols
        i, cur = i + n, cur + max(gh, gw)
    if pending:
        raise ValueError(f"{len(pending)} image(s) have no placeholder tokens in the prompt")
    return out, cur - len(ids)


def refuse_modalities(model_type: Any) -> None:
    """Raise ValueError (one line, naming the fix) for a multimodal model type this repository
    does not run; any other type passes (the caller checks its own list)."""
    need = _OTHER_MODALITIES.get(str(model_type))
    if need is not None:
        raise ValueError(
            f"model_type {model_type!r} needs {need}, which is not supported; vision-language "
            f"training supports {', '.join(VL_FAMILIES)} (images only): use a Qwen2.5-VL or "
            "Qwen3-VL (dense) checkpoint, or a text model"
        )


def refuse_data_modalities(keys: dict[str, str]) -> None:
    """Raise ValueError (one line) for a `--multimodal-keys` modality other than images."""
    bad = sorted(k for k in keys if k not in IMAGE_KEYS)
    if bad:
        raise ValueError(
            f"--multimodal-keys names {', '.join(bad)}: only images are supported (video and "
            f'audio are not); map the image column as {{"image": "<column>"}}'
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SampleImages:
    """One sample's images, preprocessed (the processor's output, done once per sample)."""

    pixels: torch.Tensor
    """`[patches, patch_dim]` float32 flattened patches, image after image."""
    grids: tuple[tuple[int, int, int], ...]
    """Each image's patch grid (t, h, w), in the order its placeholders appear."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "grids", tuple(tuple(int(v) for v in g) for g in self.grids))
        want = sum(t * h * w for t, h, w in self.grids)
        if self.pixels.dim() != 2 or self.pixels.shape[0] != want:
            raise ValueError(
                f"pixels has shape {tuple(self.pixels.shape)}; its grids {list(self.grids)} "
                f"need [{want}, patch_dim]"
            )


def image_processor(model_dir: str | None, vision: VisionSpec, *, max_pixels: int | None = None):
    """The HF image processor of a VL checkpoint: its `preprocessor_config.json` when
    `model_dir` has one, else Qwen2-VL's preprocessing with `vision`'s patch sizes (pixels
    resized to multiples of merge x patch, at most `max_pixels`, default 1024 merged tokens)."""
    from pathlib import Path

    if model_dir is not None and (Path(model_dir) / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(model_dir)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    side = vision.patch_size * vision.spatial_merge_size
    return Qwen2VLImageProcessorPil(
        min_pixels=side * side * 4,
        max_pixels=max_pixels or side * side * 1024,
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size,
    )


def preprocess(processor: Any, images: list[Any]) -> SampleImages:
    """One sample's PIL images → `SampleImages` (pixels and grids), run once per sample."""
    if not images:
        return SampleImages(pixels=torch.zeros(0, 0), grids=())
    out = processor(images=images, return_tensors="pt")
    grids = tuple(tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist())
    return SampleImages(pixels=out["pixel_values"].float(), grids=grids)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ImageRefs:
    """One sample's images by reference (local paths, base64 strings or data URIs): what
    crosses process boundaries instead of pixels; the trainer preprocesses them itself."""

    refs: tuple[str, ...]
    """The images, in the order of their placeholders."""


def read_image(ref: str) -> tuple[Any, bytes]:
    """(the RGB PIL image, its raw bytes) of a local path, a base64 string or a
    `data:image/...;base64,` URI (the data side's references; no URLs)."""
    import base64
    import binascii
    import io
    from pathlib import Path

    from PIL import Image

    if ref.startswith(("http://", "https://")):
        raise ValueError(f"image {ref[:60]!r}: URLs are not fetched; give a local path or base64")
    if ref.startswith("data:"):
        raw = base64.b64decode(ref.split(",", 1)[-1])
    elif len(ref) < 4096 and Path(ref).is_file():
        raw = Path(ref).read_bytes()
    else:
        try:
            raw = base64.b64decode(ref, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(
                f"image {ref[:60]!r} is neither an existing file nor base64 data"
            ) from None
    return Image.open(io.BytesIO(raw)).convert("RGB"), raw


def data_uri(ref: str) -> str:
    """`ref` as a `data:` URI (what the engine's `image_data` takes): a path is read."""
    import base64

    if ref.startswith("data:"):
        return ref
    _, raw = read_image(ref)
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def expand_image_pads(ids: list[int], grids: list[tuple[int, int, int]], v: VisionSpec):
    """`ids` with each image's placeholder run made as long as its grid needs: a single pad is
    expanded, a run of the right length kept; ValueError otherwise (counts that differ)."""
    out: list[int] = []
    i, k = 0, 0
    while i < len(ids):
        if ids[i] != v.image_token_id:
            out.append(ids[i])
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == v.image_token_id:
            j += 1
        if k >= len(grids):
            raise ValueError(f"the prompt has more image placeholders than images ({k})")
        need = v.image_tokens(grids[k])
        if j - i not in (1, need):
            raise ValueError(
                f"image {k} takes {need} placeholder tokens; the prompt has {j - i} (send one "
                "<|image_pad|> per image to have it expanded)"
            )
        out += [v.image_token_id] * need
        i, k = j, k + 1
    if k != len(grids):
        raise ValueError(f"{len(grids)} images but {k} image placeholders in the prompt")
    return out
