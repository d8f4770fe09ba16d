"""Which vision tower a vision-language `ModelSpec` gets, and where its checkpoint keeps it.

Owns: `build_tower` (Qwen2.5-VL's `vision.VisionTower` or Qwen3-VL's
`vision_qwen3.Qwen3VisionTower`), `tower_shapes` (name → shape of every tower tensor) and
`hf_prefixes` (the language model's and the tower's HF name prefixes per family). Must never
import the controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import torch
from torch import nn

from slime_async.contracts.vision_spec import VisionSpec
from slime_async.trainer.vision import VisionTower
from slime_async.trainer.vision_qwen3 import Qwen3VisionTower


def build_tower(spec: VisionSpec) -> nn.Module:
    """The tower of `spec`'s encoder: `VisionTower` (Qwen2.5-VL, returns the embeddings) or
    `vision_qwen3.Qwen3VisionTower` (returns them and the DeepStack features)."""
    return Qwen3VisionTower(spec) if spec.qwen3 else VisionTower(spec)


def hf_prefixes(family: str) -> tuple[str, str]:
    """(the language model's, the vision tower's) HF name prefixes of a family's checkpoint:
    Qwen2.5-VL's `save_pretrained` writes `model.layers...` and `visual.*`, Qwen3-VL's
    `model.language_model.layers...` and `model.visual.*`; text families `model.`."""
    if family == "qwen3_vl":
        return "model.language_model.", "model.visual."
    return "model.", "visual."


def tower_shapes(spec: VisionSpec) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor of `spec`'s tower (built on the meta device)."""
    with torch.device("meta"):
        tower = build_tower(spec)
    return {k: tuple(t.shape) for k, t in tower.state_dict().items()}
