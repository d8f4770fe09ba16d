"""The shape of a vision-language model's vision encoder, shared by the trainer, the engine and
the data path.

Owns: `VL_FAMILIES` (the vision-language HF `model_type`s) and `VisionSpec` (a Qwen2.5-VL or
Qwen3-VL vision encoder and patch merger, and the special token ids that place an image in the
token stream), with its conversion from and to the HF `vision_config` plus the top-level token
ids. Imports nothing from the rest of slime_async.
"""

from __future__ import annotations

import dataclasses
from typing import Any

VL_FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl")
"""The vision-language HF `model_type`s a `ModelSpec` can describe."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class VisionSpec:
    """A vision encoder: Conv3d patch embedding, `depth` pre-norm blocks with 2-D axial RoPE and
    the patch merger (2x2 patches concatenated, MLP with GELU) into the LM's width.

    `encoder` `qwen2_5_vl`: RMSNorm blocks, windowed attention but in `fullatt_block_indexes`,
    biased SwiGLU MLP. `qwen3_vl`: LayerNorm blocks, full attention, GELU-tanh MLP, a learned
    position embedding resampled to each image's grid, and DeepStack: after each block in
    `deepstack_visual_indexes` a merger of its own whose output is added to the hidden states
    of the language model's early layers (the first after layer 0, ...) at the image tokens."""

    encoder: str = "qwen2_5_vl"
    """Which encoder: `qwen2_5_vl` or `qwen3_vl` (the VL family it belongs to)."""
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
    """qwen2_5_vl: pixels per side of a windowed-attention window."""
    fullatt_block_indexes: tuple[int, ...] = (1,)
    """qwen2_5_vl: blocks with full (whole-image) attention; the others attend within windows."""
    num_position_embeddings: int = 0
    """qwen3_vl: learned positions (a square grid, bilinearly resampled per image); 0 else."""
    deepstack_visual_indexes: tuple[int, ...] = ()
    """qwen3_vl: blocks whose output feeds a DeepStack merger (LM layer k gets the k-th)."""
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
        for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))
        if self.encoder not in VL_FAMILIES:
            raise ValueError(f"vision encoder {self.encoder!r}: use one of {VL_FAMILIES}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                f"({self.num_heads})"
            )
        if (self.hidden_size // self.num_heads) % 4:
            raise ValueError("vision head_dim must be a multiple of 4 (2-D axial RoPE)")
        for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            bad = [i for i in getattr(self, name) if not 0 <= i < self.depth]
            if bad:
                raise ValueError(f"vision {name} {bad} are outside [0, {self.depth})")
        if self.qwen3 and int(self.num_position_embeddings**0.5) ** 2 != max(
            1, self.num_position_embeddings
        ):
            raise ValueError(
                f"qwen3_vl num_position_embeddings ({self.num_position_embeddings}) must be a "
                "positive square (a side x side grid)"
            )
        if not self.qwen3 and self.window_size % (self.spatial_merge_size * self.patch_size):
            raise ValueError(
                f"vision window_size ({self.window_size}) must be a multiple of "
                f"spatial_merge_size x patch_size ({self.spatial_merge_size * self.patch_size})"
            )

    @property
    def qwen3(self) -> bool:
        """A Qwen3-VL encoder (LayerNorm, learned positions, DeepStack)."""
        return self.encoder == "qwen3_vl"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (`pixel_values` columns)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def param_count(self) -> int:
        """Parameters of the encoder and mergers (what the memory plan adds for them)."""
        h, f, out = self.hidden_size, self.intermediate_size, self.out_hidden_size
        w = h * self.spatial_merge_size**2
        if not self.qwen3:
            block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (3 * h * f + 2 * f + h)
            return self.patch_dim * h + self.depth * block + h + (w * w + w) + (w * out + out)
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (2 * h * f + f + h)
        mlp = (w * w + w) + (w * out + out)
        deep = len(self.deepstack_visual_indexes) * (2 * w + mlp)
        embed = self.patch_dim * h + h + self.num_position_embeddings * h
        return embed + self.depth * block + 2 * h + mlp + deep

    def image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens of one image with patch grid `(t, h, w)`."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size**2

    def to_hf(self) -> tuple[dict[str, Any], dict[str, int]]:
        """(the HF `vision_config` dict, the top-level token ids)."""
        cfg: dict[str, Any] = dict(
            depth=self.depth,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            in_channels=self.in_channels,
            patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size,
            spatial_merge_size=self.spatial_merge_size,
            out_hidden_size=self.out_hidden_size,
            rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta},
        )
        if self.qwen3:
            cfg.update(
                hidden_act="gelu_pytorch_tanh",
                num_position_embeddings=self.num_position_embeddings,
                deepstack_visual_indexes=list(self.deepstack_visual_indexes),
            )
        else:
            cfg.update(
                hidden_act="silu",
                window_size=self.window_size,
                fullatt_block_indexes=list(self.fullatt_block_indexes),
                tokens_per_second=self.tokens_per_second,
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
        """Read the vision spec of a VL config dict (its `vision_config` and token ids)."""
        v = d.get("vision_config") or {}
        mtype = d.get("model_type", "qwen2_5_vl")
        qwen3 = mtype == "qwen3_vl"
        act, want = v.get("hidden_act", "silu"), ("gelu_pytorch_tanh" if qwen3 else "silu")
        if act != want:
            raise ValueError(f"{mtype} vision_config.hidden_act={act!r} is not supported")
        rp = v.get("rope_parameters") or {}
        extra: dict[str, Any] = (
            dict(
                num_position_embeddings=v["num_position_embeddings"],
                deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes", ())),
                fullatt_block_indexes=(),
            )
            if qwen3
            else dict(
                window_size=v.get("window_size", 112),
                fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", ())),
                tokens_per_second=v.get("tokens_per_second", 2),
            )
        )
        return cls(
            encoder=mtype,
            depth=v["depth"],
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_heads=v["num_heads"],
            in_channels=v.get("in_channels", v.get("in_chans", 3)),
            patch_size=v.get("patch_size", 16 if qwen3 else 14),
            temporal_patch_size=v.get("temporal_patch_size", 2),
            spatial_merge_size=v.get("spatial_merge_size", 2),
            out_hidden_size=v["out_hidden_size"],
            rope_theta=float(rp.get("rope_theta", 10000.0)),
            image_token_id=d.get("image_token_id", 151655),
            video_token_id=d.get("video_token_id", 151656),
            vision_start_token_id=d.get("vision_start_token_id", 151652),
            vision_end_token_id=d.get("vision_end_token_id", 151653),
            **extra,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown VisionSpec fields {sorted(unknown)}")
        return cls(**d)
