"""What a vision-language forward feeds the language model: mRoPE positions and image embeddings.

Owns: `mrope_positions` (the three position ids, temporal / row / column, of one token row:
text tokens count up on all three, an image's placeholder tokens sit on its merged patch grid
starting at the position where the image begins, and the text after it resumes past the larger
grid side; pure), `image_embeddings` (the word embeddings of a batch with the vision tower's
output written into the image placeholder positions, in megatron's `[T, B, H]` layout) and
`vl_forward` (one GPTModel forward of token rows with images, for parity checks), and
`layout_inputs` (a micro-batch's positions and images in its packed or padded row layout). Image placeholder tokens are never trained: their targets are not sampled, so the
loss mask is 0 there (`image_token_mask` says which they are). Must never import the
controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

from typing import Any

import torch

from slime_async.contracts.vision import SampleImages, VisionSpec


def mrope_positions(
    ids: list[int], grids: list[tuple[int, int, int]], vision: VisionSpec
) -> tuple[torch.Tensor, int]:
    """(`[3, T]` int64 positions of the token row `ids`, the rope delta: the next position
    minus T, which every later token, e.g. each decoded one, adds to its index).

    Raises ValueError when the placeholders do not match `grids` (one run of
    `vision.image_tokens(grid)` image tokens per image, in order)."""
    m = vision.spatial_merge_size
    out = torch.empty(3, len(ids), dtype=torch.long)
    pending = list(grids)
    i, cur = 0, 0
    while i < len(ids):
        if ids[i] != vision.image_token_id:
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
        if ids[i : i + n] != [vision.image_token_id] * n:
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


def image_token_mask(tokens: torch.Tensor, vision: VisionSpec) -> torch.Tensor:
    """Bool mask of the image placeholder positions of `tokens` (never trained)."""
    return tokens == vision.image_token_id


def image_embeddings(
    chunk: torch.nn.Module,
    tokens: torch.Tensor,
    pixels: torch.Tensor | None,
    grid_thw: torch.Tensor | None,
) -> torch.Tensor:
    """`[T, B, H]` decoder input of the first pipeline stage: word embeddings of `tokens`
    `[B, T]`, with the vision tower's embeddings of `pixels` written into the image
    placeholder positions, row-major (the order the images appear in)."""
    emb = chunk.embedding.word_embeddings(tokens)  # [B, T, H], all-reduced over TP
    vision = chunk.vision
    if pixels is not None and pixels.numel():
        feats = vision(pixels.to(emb.device), grid_thw).to(emb.dtype)
        mask = image_token_mask(tokens, vision.spec)
        if int(mask.sum()) != feats.shape[0]:
            raise ValueError(
                f"{int(mask.sum())} image placeholder tokens but {feats.shape[0]} image "
                "embeddings: the prompt and its images do not match"
            )
        emb = emb.masked_scatter(mask[..., None], feats)
    emb = emb.transpose(0, 1).contiguous()
    if chunk.config.sequence_parallel:
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        emb = scatter_to_sequence_parallel_region(emb)
    return emb


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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(`[3, rows, width]` mRoPE positions, pixels, `[images, 3]` grids) of a micro-batch whose
    samples (`tokens` `[b, w]`, right-padded) sit at `layout.starts` (`packing.RowLayout`):
    each sample's positions start at 0 (padding stays 0) and its images are concatenated in
    the order their placeholders appear in the model input. Raises ValueError when a trained
    token is an image placeholder (images are prompt, never trained)."""
    if bool((loss_mask & image_token_mask(tokens, vision)).any()):
        raise ValueError("loss_mask marks image placeholder tokens; images are never trained")
    pos = torch.zeros(3, layout.rows, layout.width, dtype=torch.long)
    pixels: list[torch.Tensor] = []
    grids: list[tuple[int, int, int]] = []
    order = sorted(range(len(layout.starts)), key=lambda i: layout.starts[i])
    for i in order:
        (r, c), n = layout.starts[i], layout.lengths[i]
        img = None if images is None else images[i]
        g = list(img.grids) if img is not None else []
        pos[:, r, c : c + n], _ = mrope_positions(tokens[i, :n].tolist(), g, vision)
        if img is not None and img.grids:
            pixels.append(img.pixels)
            grids += g
    if not grids:
        return pos, None, None
    return pos, torch.cat(pixels), torch.tensor(grids, dtype=torch.long)
