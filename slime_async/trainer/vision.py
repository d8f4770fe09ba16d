"""The trainer's vision tower: a Qwen2.5-VL vision encoder and patch merger in plain torch.

Owns: `VisionTower` (Conv3d patch embedding, `depth` pre-norm blocks with 2-D axial RoPE and
windowed attention, the 2x2 patch merger into the language model's width), the window layout
(`window_layout`) and the per-patch (row, column) positions (`patch_positions`); which tower
a spec gets is `towers.py`'s. Parameter
names are the HF checkpoint's names under `visual.` (`blocks.{i}.attn.qkv.weight`,
`merger.mlp.0.weight`, ...), so the HF mapping is the prefix alone (`hf_convert.py`). The tower
is not tensor- or pipeline-parallel: it is small next to the language model and lives, whole,
on the first pipeline stage (`model.build_model`). Must never import the controller, engine,
rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from slime_async.contracts.vision import VisionSpec

_EPS = 1e-6


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the input dtype (HF's Qwen2.5-VL norm)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + _EPS)
        return self.weight * h.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        k = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.in_channels, spec.hidden_size, k, stride=k, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        s = self.spec
        x = pixels.view(-1, s.in_channels, s.temporal_patch_size, s.patch_size, s.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, s.hidden_size)


class Attention(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.heads = spec.num_heads
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, bounds: list[int], cos: torch.Tensor, sin: torch.Tensor):
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, dim]
        out = [
            F.scaled_dot_product_attention(q[:, s:e], k[:, s:e], v[:, s:e])
            for s, e in itertools.pairwise(bounds)
            if e > s
        ]
        return self.proj(torch.cat(out, 1).transpose(0, 1).reshape(n, -1))


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of `[n, heads, dim]` in fp32 (cos/sin `[n, dim]`), back in `t`'s dtype."""
    x = t.float()
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), -1)
    return (x * cos[:, None].float() + turned * sin[:, None].float()).to(t.dtype)


class MLP(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        h, f = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=True)
        self.up_proj = nn.Linear(h, f, bias=True)
        self.down_proj = nn.Linear(f, h, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.norm1 = RMSNorm(spec.hidden_size)
        self.norm2 = RMSNorm(spec.hidden_size)
        self.attn = Attention(spec)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, bounds: list[int], cos: torch.Tensor, sin: torch.Tensor):
        x = x + self.attn(self.norm1(x), bounds, cos, sin)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """merge² neighbouring patches → one language-model token."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.width = spec.hidden_size * spec.spatial_merge_size**2
        self.ln_q = RMSNorm(spec.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width),
            nn.GELU(),
            nn.Linear(self.width, spec.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTower(nn.Module):
    """Pixels (`[patches, patch_dim]`, the processor's `pixel_values`) and each image's patch
    grid (`[images, 3]`: t, h, w) → `[patches / merge², out_hidden_size]` image embeddings,
    image after image, in the order of their placeholder tokens."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList([Block(spec) for _ in range(spec.depth)])
        self.merger = Merger(spec)
        dim = spec.head_dim // 2
        inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        s = self.spec
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        unit = s.spatial_merge_size**2
        order, windows = window_layout(grids, s)
        full = _frame_bounds(grids)
        x = self.patch_embed(pixels)
        n = x.shape[0]

        def permute(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n // unit, unit, -1)[order].reshape(n, -1)

        angles = patch_positions(grids, s.spatial_merge_size).to(x.device)[..., None].float()
        angles = (angles * self.inv_freq.to(x.device)).flatten(1)  # [n, head_dim / 2]
        angles = permute(torch.cat([angles, angles], -1))
        cos, sin = angles.cos(), angles.sin()
        x = permute(x)
        for i, blk in enumerate(self.blocks):
            x = blk(x, full if i in s.fullatt_block_indexes else windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]


def _frame_bounds(grids: list[tuple[int, int, int]]) -> list[int]:
    """Cumulative patch counts of every frame (full attention stays within a frame)."""
    out = [0]
    for t, h, w in grids:
        for _ in range(t):
            out.append(out[-1] + h * w)
    return out


def patch_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """`[patches, 2]` (row, column) of every patch, laid out block by block over merge x merge
    blocks (the order the processor flattens patches in)."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        r = rows.reshape(shape).transpose(1, 2).flatten()
        c = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([r, c], -1).repeat(t, 1))
    return torch.cat(out)


def window_layout(
    grids: list[tuple[int, int, int]], spec: VisionSpec
) -> tuple[torch.Tensor, list[int]]:
    """(the order of merged tokens window by window, cumulative patch counts per window).

    A window covers `window_size / (merge x patch)` merged tokens per side; windows tile each
    frame from its top-left corner, the last row and column of windows cut short."""
    side = spec.window_size // spec.spatial_merge_size // spec.patch_size
    unit = spec.spatial_merge_size**2
    order: list[torch.Tensor] = []
    bounds, base = [0], 0
    for t, h, w in grids:
        gh, gw = h // spec.spatial_merge_size, w // spec.spatial_merge_size
        idx = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for f in range(t):
            for r0 in range(0, gh, side):
                for c0 in range(0, gw, side):
                    win = idx[f, r0 : r0 + side, c0 : c0 + side].flatten()
                    order.append(win + base)
                    bounds.append(bounds[-1] + win.numel() * unit)
        base += t * gh * gw
    return torch.cat(order), bounds
