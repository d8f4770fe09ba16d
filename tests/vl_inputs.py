"""Inputs the vision-language tests share: the shrunk published configs (`CONFIGS`,
`raw_config`), random PNG images (`random_png`), a token prompt with image placeholders and
its pixel patches (`image_prompt`), and a seeded random tiny HF VL model saved as a checkpoint
(`seeded_vl`)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slime_async.contracts.model import ModelSpec

CONFIGS = Path(__file__).parent / "data" / "configs"


def raw_config(name: str) -> dict:
    """`tests/data/configs/<name>/config.json` as a dict."""
    return json.loads((CONFIGS / name / "config.json").read_text())


def random_png(seed: int, size: tuple[int, int]) -> bytes:
    """A PNG of random RGB noise, `size` = (width, height)."""
    from PIL import Image

    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def image_prompt(
    spec: ModelSpec, grids: Sequence[tuple[int, int, int]]
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(token ids with one image's placeholders per grid, their pixel patches, the grids)."""
    v = spec.vision
    ids = [5, 6]
    for g in grids:
        n = v.image_tokens(g)
        ids += [v.vision_start_token_id] + [v.image_token_id] * n + [v.vision_end_token_id, 7]
    ids += list(range(10, 40))
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), v.patch_dim, generator=gen)
    return ids, pixels, torch.tensor(list(grids))


def seeded_vl(
    out: Path, name: str, hf_model: Callable[[Any], Any], perturb: Callable[[torch.Tensor], Any]
) -> tuple[ModelSpec, Path, Any]:
    """(spec, checkpoint dir, fp32 HF model): `hf_model(config)` of `CONFIGS/name` seeded at 0,
    `perturb` applied to every parameter in place (so a mis-mapped piece shows), saved to
    `out/hf`."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(CONFIGS / name))
    torch.manual_seed(0)
    hf = hf_model(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            perturb(p)
    ckpt = out / "hf"
    hf.save_pretrained(str(ckpt))
    return ModelSpec.from_hf_config(cfg), ckpt, hf
