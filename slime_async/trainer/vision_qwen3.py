"""The trainer's Qwen3-VL vision tower, in plain torch beside the language model.

Owns: `Qwen3VisionTower` (Conv3d patch embedding with bias, a learned position grid resampled
bilinearly to each image's patch grid, `depth` LayerNorm blocks with 2-D axial RoPE and full
attention within each image, the merger into the language model's width, and one DeepStack
merger per `deepstack_visual_indexes` block, whose outputs the language model adds to its
early layers' hidden states at the image tokens) and `position_taps` (the resampling's four
table rows and weights per patch). Parameter names are the HF checkpoint's under
`model.visual.` (`blocks.{i}.mlp.linear_fc1.weight`, `deepstack_merger_list.{k}.norm.weight`,
...). Shares the attention, RoPE and patch order of `vision.py`. Must never import the
controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slime_async.contracts.vision_spec import VisionSpec
from slime_async.trainer.vision import Attention, _frame_bounds, patch_positions

_EPS = 1e-6


class PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        k = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, k, stride=k, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        s = self.spec
        x = pixels.view(-1, s.in_channels, s.temporal_patch_size, s.patch_size, s.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, s.hidden_size)


class MLP(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(spec.hidden_size, eps=_EPS)
        self.norm2 = nn.LayerNorm(spec.hidden_size, eps=_EPS)
        self.attn = Attention(spec)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, bounds: list[int], cos: torch.Tensor, sin: torch.Tensor):
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """merge² neighbouring patches → one language-model token; the DeepStack ones normalise
    after concatenating the patches (`post`), the final one before."""

    def __init__(self, spec: VisionSpec, *, post: bool) -> None:
        super().__init__()
        self.width, self.post = spec.hidden_size * spec.spatial_merge_size**2, post
        self.norm = nn.LayerNorm(self.width if post else spec.hidden_size, eps=_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.post else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def position_taps(
    grids: list[tuple[int, int, int]], merge: int, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[patches, 4]` rows of the `side x side` position table, `[patches, 4]` weights): each
    patch's bilinear resampling of the table onto its image's grid, corners aligned (the
    table's corners sit on the grid's corner patches), patches in the processor's order."""
    rc = patch_positions(grids, merge)
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids])
    offsets = torch.arange(2)

    def axis(i: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = i.to(torch.float32) * (side - 1) / torch.clamp(n - 1, min=1)
        lo = torch.floor(at)
        taps = (lo.long()[:, None] + offsets).clamp(0, side - 1)
        weight = (1 - (at[:, None] - lo[:, None] - offsets).abs()).clamp(min=0)
        return taps, weight

    (rt, rw), (ct, cw) = axis(rc[:, 0], sizes[:, 0]), axis(rc[:, 1], sizes[:, 1])
    rows = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
    return rows, (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)


class Qwen3VisionTower(nn.Module):
    """Pixels (`[patches, patch_dim]`) and grids (`[images, 3]`) → (`[patches / merge²,
    out_hidden_size]` image embeddings, one such tensor per DeepStack layer), image after
    image in the order of their placeholder tokens."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList([Block(spec) for _ in range(spec.depth)])
        self.merger = Merger(spec, post=False)
        self.deepstack_merger_list = nn.ModuleList(
            [Merger(spec, post=True) for _ in spec.deepstack_visual_indexes]
        )
        dim = spec.head_dim // 2
        inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(
        self, pixels: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        s = self.spec
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        x = self.patch_embed(pixels)
        side = int(s.num_position_embeddings**0.5)
        rows, weights = position_taps(grids, s.spatial_merge_size, side)
        pos = (self.pos_embed(rows.to(x.device)) * weights.to(x.device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        angles = patch_positions(grids, s.spatial_merge_size).to(x.device)[..., None].float()
        angles = (angles * self.inv_freq.to(x.device)).flatten(1)
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos(), angles.sin()
        bounds = _frame_bounds(grids)
        deep: list[torch.Tensor] = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, bounds, cos, sin)
            if i in s.deepstack_visual_indexes:
                k = s.deepstack_visual_indexes.index(i)
                deep.append(self.deepstack_merger_list[k](x))
        return self.merger(x), deep
