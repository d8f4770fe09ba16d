"""Qwen3-VL's language-model side in megatron: interleaved multimodal RoPE and DeepStack.

Owns: `InterleavedMRoPE` (megatron's multimodal rotary embedding with Qwen3-VL's frequency
layout: frequency i turns with the height position when i % 3 == 1 and i < 3 x the height
section, with the width position when i % 3 == 2 and i < 3 x the width section, else with the
temporal one), `install` (puts it in a GPTModel chunk and hooks DeepStack onto the chunk's
first `len(deepstack_visual_indexes)` decoder layers) and `set_features` (the DeepStack
features of the micro-batch the chunk forwards next: `[T, B, H]` tensors, zero but at the image
tokens, each added to the output of its decoder layer; None: no images). The features stay set
until the next micro-batch, so a recomputed layer adds the same ones. Must never import the
controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
    get_pos_emb_on_this_cp_rank,
)

from slime_async.contracts.model import ModelSpec


def interleaved_axes(section: list[int] | tuple[int, ...], n: int) -> torch.Tensor:
    """`[n]` the position axis (0 temporal, 1 height, 2 width) each of `n` frequencies turns
    with, Qwen3-VL's interleaved layout of the sections (t, h, w)."""
    axes = torch.zeros(n, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


class InterleavedMRoPE(MultimodalRotaryEmbedding):
    """`[T, B, 1, head_dim]` rotary angles of `[3, B, T]` positions, interleaved sections."""

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None):
        seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        freqs = seq[..., None].float() * self.inv_freq.float()  # [3, B, T, dim / 2]
        axes = interleaved_axes(mrope_section, freqs.shape[-1]).to(freqs.device)
        picked = freqs.gather(0, axes.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]
        emb = torch.cat((picked, picked), dim=-1)[..., None, :].transpose(0, 1).contiguous()
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, group)
        return emb


def install(chunk: torch.nn.Module, spec: ModelSpec) -> None:
    """Qwen3-VL's RoPE in `chunk`, and DeepStack on its layers where this stage holds them
    (the first pipeline stage, the one with the vision tower, must hold them all)."""
    rope = chunk.rotary_pos_emb
    assert type(rope) is MultimodalRotaryEmbedding and not rope.rotary_interleaved
    rope.__class__ = InterleavedMRoPE  # same state (inv_freq, cp group), Qwen3-VL's layout
    assert spec.vision is not None
    n = len(spec.vision.deepstack_visual_indexes)
    if getattr(chunk, "vision", None) is None or not n:
        return
    layers = {int(layer.layer_number) - 1: layer for layer in chunk.decoder.layers}
    missing = [k for k in range(n) if k not in layers]
    if missing:
        raise ValueError(
            f"DeepStack adds image features to decoder layers 0..{n - 1}; the first pipeline "
            f"stage lacks layers {missing}: give it more layers (or use fewer pipeline stages)"
        )
    chunk._deepstack = Features(n)
    for k in range(n):
        layers[k].register_forward_hook(_adder(chunk._deepstack, k))


class Features:
    """The features the hooked layers add, one tensor attribute per layer (`layer0`, ...): plain
    tensor attributes, so `parallel.drop_stale_graphs` drops their autograd graphs with the
    model's other helpers' when the trainer lets the model go."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.clear()

    def clear(self) -> None:
        for k in range(self.n):
            setattr(self, f"layer{k}", None)

    def __len__(self) -> int:
        return sum(getattr(self, f"layer{k}") is not None for k in range(self.n))


def _adder(feats: Features, k: int):
    def hook(_module: Any, _args: Any, output: Any) -> Any:
        extra = getattr(feats, f"layer{k}")
        if extra is None:
            return output
        hidden, context = output
        return hidden + extra.to(hidden.dtype), context

    return hook


def set_features(chunk: torch.nn.Module, feats: list[torch.Tensor] | None) -> None:
    """The DeepStack features (`[T, B, H]` each, as the decoder's hidden states are laid out)
    the chunk's next forward adds; None: none (a micro-batch without images)."""
    state: Features | None = getattr(chunk, "_deepstack", None)
    if state is None:
        return
    state.clear()
    for k, f in enumerate((feats or [])[: state.n]):
        setattr(state, f"layer{k}", f)
