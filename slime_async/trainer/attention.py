"""Packed-sequence (THD) core attention for megatron-core's local layer spec.

Owns: `PackedDotProductAttention`, a drop-in for megatron's local `DotProductAttention` (the
`core_attention` of `get_gpt_layer_local_spec`) that accepts `PackedSeqParams` in THD format,
and `padded_groups` / `causal_attention` (the batched path's layout, and its math over one
padded group). megatron-core 0.16.1 runs packed sequences only through TransformerEngine's attention
(`TEDotProductAttention`); its local attention asserts `packed_seq_params is None`. Everything
else on the THD path is megatron's own: `GPTModel` sizes RoPE by `max_seqlen`, `SelfAttention`
squeezes q/k/v to `[t, heads, dim]` and applies RoPE per segment of `cu_seqlens` (positions
restart at 0 in every sample), MoE and sequence parallelism see `[t, 1, hidden]`.

The samples of a packed micro-batch are attended in a few batched calls, not one per sample:
`padded_groups` sorts the segments `cu_seqlens[i]:cu_seqlens[i+1]` by length and groups
samples of similar length (each at least half its group's longest), while a group's
`[samples, heads, longest, longest]` scores stay within `GROUP_ELEMENTS` on a CPU (a core's
cache) and `SCORE_ELEMENTS` on a GPU (fewer, larger kernels); each group is
right-padded to its longest sample. All groups of a micro-batch go through one autograd
function (`_PackedGroups`) that pads, attends and writes back each group forward and backward,
so autograd keeps only the packed q, k, v and output and gets each gradient as one packed
tensor (no padded copies kept, no per-group gradients of the whole input summed; a layer's
attention ran about a tenth faster at the SmolLM2 recipe's shapes). Its forward is SDPA's
fused causal kernel with grouped-query heads (no score matrix). Right padding needs no key
mask: under the causal mask a real query sees only keys at or before it, all real; padded query
rows are computed and dropped. Nor does it need zeros: a group is gathered in one pass, each
sample's padding repeating its own last row (which no real row reads), except the backward's
output gradient, padded with zeros so that padded query rows add exact zeros to ∂k and ∂v; the
results are bitwise those of zero padding (tests/test_attention.py). The backward recomputes
the probabilities from q and k (the flash-attention idea): the query heads of one key/value
group stacked along the sequence axis share one matmul with that group's keys (no repeated
keys), the scores masked in the inputs' dtype and the softmax in fp32, and `rowsum(∂p ⊙ p)`
taken as `rowsum(∂o ⊙ o)` from the saved output. Only q, k, v and the output are kept, never a
`[heads, n, n]` tensor. A sample too long for the score budget (`SCORE_ELEMENTS`) alone runs
through `torch.nn.functional.scaled_dot_product_attention` with a causal mask forward and
backward, one call per such sample; so do unpacked (BSHD, right-padded) micro-batches. Either
way no token attends across a sample boundary and a packed sample computes exactly what it
computes alone. Settings SDPA does not express (a given mask or bias,
a non-vanilla softmax) run the parent's math per sample. Parameter names are the parent's (it
has none with the vanilla softmax). Must never import anything from `slime_async` outside
`slime_async.trainer`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

SCORE_ELEMENTS = 1 << 22
"""Most `[heads, n, n]` fp32 score elements of one sample in the batched path (16 MiB: the
backward's scores, probabilities and their gradients, a few such tensors, are alive only inside
its own call, well under the head's temporaries the memory plan counts). A sample longer than
this allows (n > 682 at 9 heads) takes SDPA alone, where one call per sample costs little next to
its n² work."""
GROUP_ELEMENTS = 1 << 19
"""Most `[samples, heads, n, n]` score elements of one batched group on a CPU (2 MiB in fp32:
the backward's few tensors of that shape stay in a core's cache; groups of 32 SmolLM2 samples of
~100 tokens ran its backward slower than groups of 6-8). A GPU groups up to `SCORE_ELEMENTS`
(fewer, larger kernels: on an H200 those 32 samples are one group, a layer's forward+backward
1.6 ms; docs/results/2026-11-27-memory-plan.md)."""


@dataclasses.dataclass(frozen=True)
class Group:
    """Samples attended in one batched call: right-padded to `width`."""

    width: int
    """The longest sample's length."""
    spans: tuple[tuple[int, int], ...]
    """`(start, length)` in the packed input of each sample, in padded row order."""
    gather: torch.Tensor
    """`[samples · width]` int64: the packed row each padded row is read from (in a sample's
    padding, its own last token)."""
    pad: torch.Tensor
    """`[padding rows]` int64: the padded rows that hold no token."""

    @property
    def samples(self) -> int:
        return len(self.spans)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one packed micro-batch is attended: batched groups and long single samples."""

    groups: tuple[Group, ...]
    alone: tuple[tuple[int, int], ...]
    """`(start, end)` of each sample too long for the score budget (its own SDPA call)."""
    alone_rows: torch.Tensor
    """`[tokens]` int64: the packed positions of the `alone` samples' tokens, in order."""


def group_budget(device: torch.device | str) -> int:
    """Most score elements of one batched group on `device` (`GROUP_ELEMENTS` on a CPU,
    `SCORE_ELEMENTS` elsewhere)."""
    return GROUP_ELEMENTS if torch.device(device).type == "cpu" else SCORE_ELEMENTS


@functools.lru_cache(maxsize=16)
def padded_groups(bounds: tuple[int, ...], heads: int, device: torch.device) -> Plan:
    """The batched layout of the packed samples `bounds` (`cu_seqlens`) for `heads` query
    heads (see the module docstring)."""
    segs = sorted(((e - s, s) for s, e in itertools.pairwise(bounds) if e > s), key=lambda x: -x[0])
    budget = group_budget(device)
    members: list[list[tuple[int, int]]] = []
    alone: list[tuple[int, int]] = []
    for n, s in segs:
        if heads * n * n > SCORE_ELEMENTS:
            alone.append((s, s + n))
            continue
        cur = members[-1] if members else None
        if cur and 2 * n >= cur[0][0] and (len(cur) + 1) * heads * cur[0][0] ** 2 <= budget:
            cur.append((n, s))
        else:
            members.append([(n, s)])
    groups = []
    for mem in members:
        width = mem[0][0]
        # each sample's padding repeats its own last token: nothing reaches another sample
        gather = torch.cat([torch.arange(s, s + width).clamp_(max=s + n - 1) for n, s in mem])
        pad = torch.cat(
            [torch.arange(b * width + n, (b + 1) * width) for b, (n, _) in enumerate(mem)]
        )
        spans = tuple((s, n) for n, s in mem)
        groups.append(Group(width, spans, gather.to(device), pad.to(device)))
    rows = [torch.arange(s, e) for s, e in alone]
    alone_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    return Plan(tuple(groups), tuple(alone), alone_rows.to(device))


def _probs(qs: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """fp32 causal softmax `[b, g, r·n, n]` of stacked, already scaled queries `[b, g, r·n, d]`
    over keys `[b, g, n, d]` (query row i sits at position i mod n): the scores masked in the
    inputs' dtype, the softmax computed and returned in fp32 (one pass: no fp32 copy of the
    scores first)."""
    n = ks.shape[-2]
    pos = torch.arange(qs.shape[-2], device=qs.device) % n
    mask = torch.arange(n, device=qs.device)[None, :] > pos[:, None]
    s = (qs @ ks.transpose(-1, -2)).masked_fill_(mask, float("-inf"))
    return torch.softmax(s, -1, dtype=torch.float32)


def _stack(x: torch.Tensor, g: int) -> torch.Tensor:
    """`[b, n, heads, d]` → `[b, g, (heads / g)·n, d]`: the query heads of each key/value group
    stacked along the sequence axis (a copy)."""
    b, n, h, d = x.shape
    return x.view(b, n, g, h // g, d).permute(0, 2, 3, 1, 4).reshape(b, g, (h // g) * n, d)


def _unstack(x: torch.Tensor, n: int) -> torch.Tensor:
    """`_stack`'s inverse: `[b, g, r·n, d]` → `[b, n, g·r, d]`."""
    b, g, rn, d = x.shape
    return x.view(b, g, rn // n, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, g * (rn // n), d)


class _CausalAttention(torch.autograd.Function):
    """Softmax attention with a causal mask of right-padded `q` `[b, n, heads, d]` over `k`/`v`
    `[b, n, groups, d]`. The forward is SDPA's fused kernel (no score matrix); the backward
    recomputes the probabilities from q and k (q, k, v and the output are saved), the query
    heads of a key/value group stacked into one matmul with that group's keys."""

    @staticmethod
    def forward(ctx: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):  # type: ignore[override]
        out = _sdpa_causal(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple:  # type: ignore[override]
        q, k, v, out = ctx.saved_tensors
        return (*_causal_grads(q, k, v, out, g, ctx.scale), None)


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA's fused causal forward of right-padded `[b, n, heads, d]` q over `[b, n, groups, d]`
    k/v → `[b, n, heads, d]` (a view)."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[2],
    ).transpose(1, 2)


def _causal_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    g: torch.Tensor,
    c: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(∂q, ∂k, ∂v) of `_sdpa_causal(q, k, v, c)` = `out` under the output gradient `g`: with
    D = rowsum(∂o ⊙ o) (flash attention's: equal to rowsum(∂p ⊙ p)) and the scale taken into q
    and k (d columns, not n), ∂s = p ⊙ (∂p − D), ∂q = ∂s·k·c, ∂k = ∂sᵀ·q·c, ∂v = pᵀ·∂o."""
    groups, n = k.shape[2], k.shape[1]
    g = g.to(v.dtype)
    qs = _stack(q, groups) * c
    ks, vs = k.transpose(1, 2), v.transpose(1, 2)
    p = _probs(qs, ks)
    d = (g.float() * out.float()).sum(-1)  # [b, n, heads]
    d = _stack(d.unsqueeze(-1), groups)  # [b, g, r·n, 1]
    g = _stack(g, groups)
    gv = p.to(v.dtype).transpose(-1, -2) @ g
    gs = (g @ vs.transpose(-1, -2)).float().sub_(d).mul_(p).to(q.dtype)
    gq, gk = gs @ (ks * c), gs.transpose(-1, -2) @ qs
    return _unstack(gq, n), gk.transpose(1, 2), gv.transpose(1, 2)


def _padded(x: torch.Tensor, grp: Group, *, zeros: bool = False) -> torch.Tensor:
    """A group's rows of packed `[t, ...]` right-padded → `[samples, width, ...]`, in one
    gather. A sample's padding repeats its own last row, which none of its real rows reads
    under the causal mask (and no other sample's row sees); `zeros`: the padding is zero
    instead, which the backward's output gradient needs (a padded query row with a zero
    gradient adds exact zeros to ∂k and ∂v)."""
    rows = x.index_select(0, grp.gather)
    if zeros and grp.pad.numel():
        rows.index_fill_(0, grp.pad, 0)
    return rows.view(grp.samples, grp.width, *x.shape[1:])


def _unpad_into(packed: torch.Tensor, grp: Group, x: torch.Tensor) -> None:
    """Write a group's real rows of padded `[samples, width, ...]` `x` (any strides) into
    packed `[t, ...]`, one copy per sample (a few times faster here than gathering the rows
    and scattering them by index, which copies twice and row by row)."""
    for b, (start, n) in enumerate(grp.spans):
        packed[start : start + n].copy_(x[b, :n])


class _PackedGroups(torch.autograd.Function):
    """Causal attention of the batched groups of one packed micro-batch (`Plan.groups`):
    packed `[t, heads, d]` q and `[t, groups, d]` k/v → `[t, heads, d]`, each group padded,
    attended (`_sdpa_causal`) and written back, forward and backward, inside the function.
    Autograd then keeps the packed q, k, v and output, and each gradient is written row by row
    into one packed tensor: no padded copies kept between forward and backward, no per-group
    gradient of the whole packed tensor summed over the groups. Rows of samples attended alone
    (`Plan.alone`) are zero, forward and backward."""

    @staticmethod
    def forward(
        ctx: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, scale: float
    ):  # type: ignore[override]
        out = q.new_zeros(q.shape) if plan.alone else torch.empty_like(q)
        for grp in plan.groups:
            o = _sdpa_causal(_padded(q, grp), _padded(k, grp), _padded(v, grp), scale)
            _unpad_into(out, grp, o)
        ctx.save_for_backward(q, k, v, out)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple:  # type: ignore[override]
        q, k, v, out = ctx.saved_tensors
        plan = ctx.plan
        new = torch.zeros_like if plan.alone else torch.empty_like
        grads = new(q), new(k), new(v)
        for grp in plan.groups:
            padded = (*(_padded(x, grp) for x in (q, k, v, out)), _padded(g, grp, zeros=True))
            for packed, x in zip(grads, _causal_grads(*padded, ctx.scale), strict=True):
                _unpad_into(packed, grp, x)
        return (*grads, None, None)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of right-padded `q` `[b, n, heads, d]`, `k`/`v` `[b, n, groups, d]`
    (query heads grouped as megatron groups them: `heads / groups` consecutive heads per
    key/value group) → `[b, n, heads, d]`."""
    return _CausalAttention.apply(q, k, v, scale)


class PackedDotProductAttention(DotProductAttention):
    """Local attention that also takes THD-packed inputs (see the module docstring)."""

    batched: bool = True
    """Packed samples attended in batched groups; False: one SDPA call per sample (the
    reference the batched path is tested and benchmarked against)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: object = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object = None,
    ) -> torch.Tensor:
        fused = (
            self.config.softmax_type == "vanilla"
            and not self.config.apply_query_key_layer_scaling
            and attention_bias is None
        )
        if packed_seq_params is None:
            if fused and attention_mask is None:
                return self._causal(query, key, value)
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        bounds = self._bounds(query, attention_mask, attention_bias, packed_seq_params)
        no_dropout = not self.training or self.config.attention_dropout == 0.0
        if fused and no_dropout and self.batched:
            return self._batched(query, key, value, bounds)
        # [t, heads, dim] → per segment [n, 1, heads, dim] → [n, 1, heads * dim]
        one = self._causal if fused else super().forward
        out = [
            one(query[s:e].unsqueeze(1), key[s:e].unsqueeze(1), value[s:e].unsqueeze(1), None)
            for s, e in itertools.pairwise(bounds)
            if e > s
        ]
        return torch.cat(out, 0)

    @staticmethod
    def _bounds(
        query: torch.Tensor, mask: object, bias: object, packed_seq_params: object
    ) -> tuple[int, ...]:
        """The checked `cu_seqlens` of a packed (THD) call."""
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"packed attention supports qkv_format='thd', got {packed_seq_params.qkv_format!r}"
            )
        if mask is not None or bias is not None:
            raise ValueError("packed (THD) attention builds its own causal mask per sample")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if bounds != packed_seq_params.cu_seqlens_kv.tolist():
            raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        if bounds[-1] != query.shape[0]:
            raise ValueError(
                f"cu_seqlens covers {bounds[-1]} tokens but the packed input has {query.shape[0]}"
            )
        return tuple(bounds)

    def _batched(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: tuple
    ) -> torch.Tensor:
        """Packed `[t, heads, dim]` q and `[t, groups, dim]` k/v → `[t, 1, heads · dim]`,
        attended group by group (`padded_groups`)."""
        plan = padded_groups(bounds, query.shape[1], query.device)
        out = _PackedGroups.apply(query, key, value, plan, self.softmax_scale)
        out = out.reshape(out.shape[0], 1, self.hidden_size_per_partition)
        if plan.alone:  # their rows of `out` are zero: each sample's own SDPA call's instead
            one = [
                self._causal(
                    query[s:e].unsqueeze(1), key[s:e].unsqueeze(1), value[s:e].unsqueeze(1)
                )
                for s, e in plan.alone
            ]
            out = out.index_copy(0, plan.alone_rows, torch.cat(one, 0))
        return out

    def _causal(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, _mask: object = None
    ) -> torch.Tensor:
        """Causal attention of `[s, b, heads, dim]` query and `[s, b, groups, dim]` key/value
        through SDPA → `[s, b, heads * dim]` (key/value repeated per query group, as the
        parent does)."""
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, dim]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.config.attention_dropout if self.training else 0.0,
            scale=self.softmax_scale,
        )
        s, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)
