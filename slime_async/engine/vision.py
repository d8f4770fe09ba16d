"""Images in the embedded engine: SGLang's `image_data`, placeholders, and the prefill's inputs.

Owns: `EngineImages` (one request's preprocessed images and their digest), `decode_image` (a
base64 string or a `data:image/...;base64,` URI; URLs and file paths are refused, the engine
reads nothing a request names; `protocol.parse_image_data` reads the field), `with_images` and
`attach_images` (decode, preprocess with the checkpoint's processor, expand each image's
single `<|image_pad|>` into its grid's count or check an expanded run,
`contracts.vision.expand_image_pads`; runs off the event loop) and `prefill_inputs` (the embeddings with image features written into the placeholder
positions and the three mRoPE position ids of a prefill's new tokens, plus each row's rope
delta for decoding). Must never import the server, the scheduler or aiohttp.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
from typing import Any

import torch

from slime_async.contracts.vision import (
    SampleImages,
    VisionSpec,
    expand_image_pads,
    mrope_positions,
    preprocess,
)
from slime_async.engine.protocol import GenerateRequest
from slime_async.engine.sampling import RequestError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineImages:
    """One request's images, preprocessed once."""

    images: SampleImages
    """Pixels and grids, in the order of the prompt's placeholders."""
    digest: str
    """sha256 of the raw image bytes: a prefix is shared only between requests with the same
    images (the placeholders alone do not say which image they hold)."""


def decode_image(s: str) -> tuple[Any, bytes]:
    """(the PIL image, its raw bytes) of a base64 string or a `data:image/*;base64,` URI."""
    from PIL import Image, UnidentifiedImageError

    if s.startswith(("http://", "https://", "file:", "/", "./")):
        raise RequestError(
            "image_data must carry the image itself (base64 or a data:image/...;base64, URI); "
            "the embedded engine fetches no URLs and reads no files"
        )
    body = s.split(",", 1)[1] if s.startswith("data:") and "," in s else s
    try:
        raw = base64.b64decode(body, validate=True)
        return Image.open(io.BytesIO(raw)).convert("RGB"), raw
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as e:
        raise RequestError(f"image_data holds no decodable image ({type(e).__name__})") from None


def attach_images(prompt: list[int], strings: list[str], lm: Any) -> tuple[list[int], Any]:
    """(the prompt with expanded placeholders, `EngineImages` or None) of one input."""
    v: VisionSpec | None = getattr(lm, "vision", None)
    if not strings:
        if v is not None and v.image_token_id in prompt:
            raise RequestError("the prompt has image placeholders but no image_data")
        return prompt, None
    if v is None:
        raise RequestError(f"image_data needs a vision-language model; this is {lm.model_type}")
    decoded = [decode_image(s) for s in strings]
    images = preprocess(lm.image_processor, [im for im, _ in decoded])
    digest = hashlib.sha256(b"".join(hashlib.sha256(r).digest() for _, r in decoded)).hexdigest()
    try:
        expanded = expand_image_pads(prompt, list(images.grids), v)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return expanded, EngineImages(images=images, digest=digest)


def with_images(req: GenerateRequest, eng: Any) -> GenerateRequest:
    """`req` with each item's `image_data` decoded and preprocessed (once per distinct input)
    and its placeholders expanded (`engine.vision.attach_images`); the expanded prompt must
    still fit the context."""
    done: dict[tuple[tuple[int, ...], tuple[str, ...]], tuple[list[int], object]] = {}
    items = []
    for it in req.items:
        key = (tuple(it.prompt), it.image_data)
        if key not in done:
            done[key] = attach_images(it.prompt, list(it.image_data), eng.lm)
        prompt, images = done[key]
        ctx = eng.limits.context_length
        if len(prompt) + it.params.max_new_tokens > ctx:
            raise RequestError(
                f"with its images the prompt has {len(prompt)} tokens; + max_new_tokens "
                f"{it.params.max_new_tokens} is over the engine's context length of {ctx}"
            )
        items.append(dataclasses.replace(it, prompt=list(prompt), images=images, image_data=()))
    return dataclasses.replace(req, items=items)


@torch.no_grad()
def prefill_inputs(
    lm: Any, full: list[list[int]], plen: list[int], images: list[Any], width: int
) -> tuple[dict[str, Any], torch.Tensor]:
    """(the decoder's inputs, `[n]` rope deltas) of a prefill whose row i forwards
    `full[i][plen[i]:]` left-padded to `width`: `inputs_embeds` `[n, width, H]` with image
    features in the placeholders among the forwarded tokens (an image partly in the reused
    prefix gives its last features), `position_ids` `[3, n, width]`, the whole row's mRoPE ids
    from `plen[i]` on, and for Qwen3-VL the DeepStack features of those placeholders
    (`visual_pos_masks`, `deepstack_visual_embeds`)."""
    model = lm.model.model
    v: VisionSpec = lm.vision
    embed = model.get_input_embeddings()
    rows, pos, deltas = [], torch.zeros(3, len(full), width, dtype=torch.long), []
    masks, deep = torch.zeros(len(full), width, dtype=torch.bool), []
    for i, (ids, c) in enumerate(zip(full, plen)):
        new = torch.tensor(ids[c:], dtype=torch.long)
        e = embed(new)
        img: EngineImages | None = images[i]
        grids = list(img.images.grids) if img is not None else []
        p3, delta = mrope_positions(ids, grids, v)
        pad = width - len(new)
        where = new == v.image_token_id
        n_new = int(where.sum()) if img is not None else 0
        if n_new:
            out = model.get_image_features(
                img.images.pixels.to(model.visual.dtype), torch.tensor(grids)
            )
            e = e.masked_scatter(where[:, None], torch.cat(out.pooler_output)[-n_new:].to(e.dtype))
            if v.qwen3:
                masks[i, pad:] = where
                deep.append([torch.cat(f)[-n_new:].to(e.dtype) for f in out.deepstack_features])
        rows.append(torch.cat([e.new_zeros(pad, e.shape[1]), e]))
        pos[:, i, pad:] = p3[:, c:]
        deltas.append(delta)
    inputs: dict[str, Any] = {"inputs_embeds": torch.stack(rows), "position_ids": pos}
    if deep:  # per layer: the rows' features, row after row (the mask's order)
        inputs["visual_pos_masks"] = masks
        inputs["deepstack_visual_embeds"] = [torch.cat(layer) for layer in zip(*deep)]
    return inputs, torch.tensor(deltas, dtype=torch.long)
