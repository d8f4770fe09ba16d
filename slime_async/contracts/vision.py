"""The vision side of a vision-language model, shared by the trainer, the engine and the data path.

Owns: `VisionSpec` (the shape of a Qwen2.5-VL vision encoder and patch merger, and the special
token ids that place an image in the token stream), its conversion from and to the HF
`vision_config` plus the top-level token ids, `refuse_modalities` (the one-line refusal of
model types and data keys this repository does not run: video, audio, omni models) and
`image_tokens` (how many placeholder tokens an image of a given patch grid takes),
`mrope_positions` (the three position ids, temporal / row / column, of one token row: text
tokens count up on all three, an image's placeholders sit on its merged patch grid starting
where the image begins, the text after it resumes past the larger grid side; pure; the trainer
and the engine both use it), `image_processor` (the one preprocessing of an image, which the
data path and the engine share, so both count the same placeholders), and
`SampleImages` (one sample's preprocessed images as the trainer reads them), `ImageRefs` (the
same by reference: paths or base64, what crosses Ray), `read_image` / `data_uri` (a reference's
bytes) and `expand_image_pads` (one pad per image → its grid's count). Imports nothing from the
rest of slime_async.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

VL_FAMILIES: tuple[str, ...] = ("qwen2_5_vl",)
"""The vision-language HF `model_type`s a `ModelSpec` can describe."""

_OTHER_MODALITIES = {
    "qwen2_audio": "audio",
    "qwen2_5_omni": "audio and video",
    "qwen2_5_omni_thinker": "audio and video",
    "qwen3_omni_moe": "audio and video",
    "qwen3_omni_moe_thinker": "audio and video",
    "qwen3_vl": "the Qwen3-VL vision encoder",
    "qwen3_vl_moe": "the Qwen3-VL vision encoder",
    "qwen2_vl": "the Qwen2-VL vision encoder",
    "whisper": "audio",
    "llava": "the LLaVA vision encoder",
}
"""Multimodal model types that are refused at parse time, and what they would need."""

IMAGE_KEYS: tuple[str, ...] = ("image", "images")
"""`--multimodal-keys` modalities the data path carries (everything else is refused)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VisionSpec:
    """A Qwen2.5-VL vision encoder: Conv3d patch embedding, `depth` pre-norm blocks (RMSNorm,
    2-D axial RoPE, windowed attention but in `fullatt_block_indexes`, biased SwiGLU MLP), and
    the patch merger (RMSNorm, 2x2 patches concatenated, MLP with GELU) into the LM's width."""

    depth: int = 2
    """Vision transformer blocks."""
    hidden_size: int = 32
    """Vision width."""
    intermediate_size: int = 64
    """Vision MLP width."""
    num_heads: int = 2
    """Vision attention heads."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 14
    """Pixels per patch side."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """Patches per merged token side: one LM token covers merge² patches."""
    window_size: int = 112
    """Pixels per side of a windowed-attention window."""
    fullatt_block_indexes: tuple[int, ...] = (1,)
    """Blocks with full (whole-image) attention; the others attend within windows."""
    out_hidden_size: int = 128
    """Merger output width (= the LM's hidden size)."""
    tokens_per_second: int = 2
    """Temporal rope spacing of video frames (read for fidelity; videos are refused)."""
    rope_theta: float = 10000.0
    """Base of the vision encoder's axial RoPE."""
    image_token_id: int = 252
    """The image placeholder token (`<|image_pad|>`), one per merged patch."""
    video_token_id: int = 253
    """The video placeholder token (refused in prompts)."""
    vision_start_token_id: int = 250
    """`<|vision_start|>`, in front of an image's placeholders."""
    vision_end_token_id: int = 251
    """`<|vision_end|>`, after them."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes)
        )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if (self.hidden_size // self.num_heads) % 4:
            raise ValueError("vision head_dim must be a multiple of 4 (2-D axial RoPE)")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision fullatt_block_indexes {bad} are outside [0, {self.depth})")
        if self.window_size % (self.spatial_merge_size * self.patch_size):
            raise ValueError(
                f"vision window_size ({self.window_size}) must be a multiple of "
                f"spatial_merge_size x patch_size ({self.spatial_merge_size * self.patch_size})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (`pixel_values` columns)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def param_count(self) -> int:
        """Parameters of the encoder and merger (what the memory plan adds for them)."""
        h, f, out = self.hidden_size, self.intermediate_size, self.out_hidden_size
        block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (3 * h * f + 2 * f + h)
        w = h * self.spatial_merge_size**2
        merger = h + (w * w + w) + (w * out + out)
        return self.patch_dim * h + self.depth * block + merger

    def image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens of one image with patch grid `(t, h, w)`."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size**2

    def to_hf(self) -> tuple[dict[str, Any], dict[str, int]]:
        """(the HF `vision_config` dict, the top-level token ids)."""
        cfg = dict(
            depth=self.depth,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            in_channels=self.in_channels,
            patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size,
            spatial_merge_size=self.spatial_merge_size,
            window_size=self.window_size,
            fullatt_block_indexes=list(self.fullatt_block_indexes),
            out_hidden_size=self.out_hidden_size,
            tokens_per_second=self.tokens_per_second,
            hidden_act="silu",
            rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta},
        )
        ids = dict(
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            vision_start_token_id=self.vision_start_token_id,
            vision_end_token_id=self.vision_end_token_id,
        )
        return cfg, ids

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> VisionSpec:
        """Read the vision spec of a `qwen2_5_vl` config dict (its `vision_config` and ids)."""
        v = d.get("vision_config") or {}
        act = v.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"qwen2_5_vl vision_config.hidden_act={act!r} is not supported")
        rp = v.get("rope_parameters") or {}
        return cls(
            depth=v["depth"],
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_heads=v["num_heads"],
            in_channels=v.get("in_channels", v.get("in_chans", 3)),
            patch_size=v.get("patch_size", 14),
            temporal_patch_size=v.get("temporal_patch_size", 2),
            spatial_merge_size=v.get("spatial_merge_size", 2),
            window_size=v.get("window_size", 112),
            fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", ())),
            out_hidden_size=v["out_hidden_size"],
            tokens_per_second=v.get("tokens_per_second", 2),
            rope_theta=float(rp.get("rope_theta", 10000.0)),
            image_token_id=d.get("image_token_id", 151655),
            video_token_id=d.get("video_token_id", 151656),
            vision_start_token_id=d.get("vision_start_token_id", 151652),
            vision_end_token_id=d.get("vision_end_token_id", 151653),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown VisionSpec fields {sorted(unknown)}")
        return cls(**d)


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
            f"training supports {', '.join(VL_FAMILIES)} (images only): use a Qwen2.5-VL "
            "checkpoint, or a text model"
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
