"""What a vision-language forward feeds the language model: mRoPE positions and image embeddings.

Owns: `image_embeddings` (the word embeddings of a batch with the vision tower's
output written into the image placeholder positions, in megatron's `[T, B, H]` layout) and
`vl_forward` (one GPTModel forward of token rows with images, for parity checks), and
`ImageResolver` (images that came by reference, preprocessed here once each), and
`layout_inputs` (a micro-batch's positions, `contracts.vision.mrope_positions`, and images in
its packed or padded row layout). Image placeholder tokens are never trained: their targets are not sampled, so the
loss mask is 0 there (`image_token_mask` says which they are). Must never import the
controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

from typing import Any

import torch

from slime_async.contracts.vision import (
    ImageRefs,
    SampleImages,
    VisionSpec,
    image_processor,
    mrope_positions,
    preprocess,
    read_image,
)


def image_token_mask(tokens: torch.Tensor, vision: VisionSpec) -> torch.Tensor:
    """Bool mask of the image placeholder positions of `tokens` (never trained)."""
    return tokens == vision.image_token_id


def image_embeddings(
    chunk: torch.nn.Module,
    tokens: torch.Tensor,
    pixels: torch.Tensor | None,
    grid_thw: torch.Tensor | None,
    where: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[T, B, H]` decoder input of the first pipeline stage: word embeddings of `tokens`
    `[B, T]`, with the vision tower's embeddings of `pixels` written into the image
    placeholder positions (`where`, default every image token), row-major (the order the images
    appear in). A Qwen3-VL tower's DeepStack features go to the chunk's early layers the same
    way (`deepstack.set_features`)."""
    emb = chunk.embedding.word_embeddings(tokens)  # [B, T, H], all-reduced over TP
    vision = chunk.vision
    deep: list[torch.Tensor] | None = None
    if pixels is not None and pixels.numel():
        out = vision(pixels.to(emb.device), grid_thw)
        feats, extra = out if isinstance(out, tuple) else (out, [])
        mask = image_token_mask(tokens, vision.spec) if where is None else where.to(emb.device)
        if int(mask.sum()) != feats.shape[0]:
            raise ValueError(
                f"{int(mask.sum())} image placeholder tokens but {feats.shape[0]} image "
                "embeddings: the prompt and its images do not match"
            )
        emb = emb.masked_scatter(mask[..., None], feats.to(emb.dtype))
        deep = [
            _layout(chunk, torch.zeros_like(emb).masked_scatter(mask[..., None], f.to(emb.dtype)))
            for f in extra
        ]
    if vision.spec.qwen3:
        from slime_async.trainer import deepstack

        deepstack.set_features(chunk, deep or None)
    return _layout(chunk, emb)


def _layout(chunk: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`[B, T, H]` → the decoder's `[T, B, H]` (scattered over TP with sequence parallelism)."""
    x = x.transpose(0, 1).contiguous()
    if chunk.config.sequence_parallel:
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        x = scatter_to_sequence_parallel_region(x)
    return x


def vl_forward(
    chunk: torch.nn.Module,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    pixels: torch.Tensor | None,
    grid_thw: torch.Tensor | None,
    **kwargs: object,
) -> torch.Tensor:
    """The GPTModel forward of `[B, T]` token rows with their images (`positions`: `[3, B, T]`
    mRoPE ids); returns what the model returns (hidden states or logits)."""
    decoder_input = image_embeddings(chunk, tokens, pixels, grid_thw)
    return chunk(tokens, positions, attention_mask=None, decoder_input=decoder_input, **kwargs)


def layout_inputs(
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    images: tuple[SampleImages | None, ...] | None,
    layout: Any,
    vision: VisionSpec,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(`[3, rows, width]` mRoPE positions, pixels, `[images, 3]` grids, `[rows, width]` the
    placeholder positions) of a micro-batch whose
    samples (`tokens` `[b, w]`, right-padded) sit at `layout.starts` (`packing.RowLayout`):
    each sample's positions start at 0 (padding stays 0) and its images are concatenated in
    the order their placeholders appear in the model input. Placeholders are the image tokens
    outside the loss mask (prompt tokens; a sampled image token id is trained text); ValueError
    when they do not fit the images."""
    placeholders = image_token_mask(tokens, vision) & ~loss_mask  # a sampled one is text
    pos = torch.zeros(3, layout.rows, layout.width, dtype=torch.long)
    where = torch.zeros(layout.rows, layout.width, dtype=torch.bool)
    pixels: list[torch.Tensor] = []
    grids: list[tuple[int, int, int]] = []
    order = sorted(range(len(layout.starts)), key=lambda i: layout.starts[i])
    for i in order:
        (r, c), n = layout.starts[i], layout.lengths[i]
        img = None if images is None else images[i]
        g = list(img.grids) if img is not None else []
        is_image = placeholders[i, :n]
        try:
            pos[:, r, c : c + n], _ = mrope_positions(
                tokens[i, :n].tolist(), g, vision, is_image=is_image.tolist()
            )
        except ValueError as e:
            raise ValueError(f"sample {i}: {e} (a placeholder in the loss mask?)") from None
        where[r, c : c + n] = is_image
        if img is not None and img.grids:
            pixels.append(img.pixels)
            grids += g
    if not grids:
        return pos, None, None, where
    return pos, torch.cat(pixels), torch.tensor(grids, dtype=torch.long), where


class ImageResolver:
    """`ImageRefs` → `SampleImages` with the checkpoint's image processor; each distinct set of
    references is read and preprocessed once (kept in a bounded cache), so pixels never cross
    a process boundary while a path (or the base64 the data carries) suffices."""

    def __init__(self, model_dir: str | None, vision: VisionSpec, *, capacity: int = 4096):
        self.model_dir, self.vision, self.capacity = model_dir, vision, capacity
        self._processor: Any = None
        self._cache: dict[tuple[str, ...], SampleImages] = {}

    def __call__(self, img: SampleImages | ImageRefs | None) -> SampleImages | None:
        if not isinstance(img, ImageRefs):
            return img
        hit = self._cache.get(img.refs)
        if hit is None:
            if self._processor is None:
                self._processor = image_processor(self.model_dir, self.vision)
            hit = preprocess(self._processor, [read_image(r)[0] for r in img.refs])
            if len(self._cache) >= self.capacity:
                self._cache.pop(next(iter(self._cache)))
            self._cache[img.refs] = hit
        return hit
