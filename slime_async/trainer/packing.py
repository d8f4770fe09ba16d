"""Micro-batch plans and the row layout of a micro-batch (pure functions, no torch.distributed).

Owns: `plan_micro_batches` (which samples of each data-parallel shard form each micro-batch:
a fixed sample count, or a token budget filled longest-first and balanced) and `RowLayout`
(where each sample of a micro-batch sits in the model's `[rows, width]` input: packed THD —
one row, samples back to back, `cu_seqlens` — or padded BSHD — one row per sample), with the
index maps that turn per-position model outputs back into token-aligned `[b, w]` tensors (and
`read_positions`: the positions a token-aligned mask reads, the only ones the LM head computes).
Must never import anything from `slime_async` outside `slime_async.trainer` and contracts.

Worked example (token budget 10, DP 1, lengths [7, 2, 5, 3, 1]): first-fit decreasing needs
2 micro-batches; longest first into the lighter one → rows {0, 1} (7 + 2 tokens) and
{2, 3, 4} (5 + 3 + 1). Packed, micro-batch {2, 3, 4} is one row of 9 tokens with
`cu_seqlens = [0, 5, 8, 9]`; token t ≥ 1 of row 3 is column 5 + t, and its log-prob is read
from the position before it (column 5 + t − 1, which never lies in row 2's sample).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch


def plan_micro_batches(
    lengths: list[int],
    *,
    dp: int,
    micro_batch_size: int,
    max_tokens: int | None = None,
    multiple_of: int = 1,
) -> list[list[list[int]]]:
    """Per DP rank, its micro-batches as row indices into its contiguous shard of `lengths`.

    Every rank receives the whole batch, so every rank computes every shard's plan and all
    agree without communication. Fixed (`max_tokens` None): consecutive `micro_batch_size`
    rows. Token budget: `n` = the most micro-batches any shard needs (first-fit decreasing),
    rounded up to `multiple_of` (the interleaved schedule needs a multiple of PP), then every
    shard's samples go longest-first into the least-loaded micro-batch they fit in, so all
    shards run the same `n` micro-batches (EP and PP collectives need equal counts); `n` grows
    until every shard fits. A sample longer than the budget gets a micro-batch of its own.
    Raises ValueError when the shards cannot be split into a multiple of `multiple_of`.
    """
    if len(lengths) % dp:
        raise ValueError(
            f"batch size {len(lengths)} is not divisible by the data-parallel size {dp}; "
            "make the global batch a multiple of DP"
        )
    per = len(lengths) // dp
    shards = [lengths[r * per : (r + 1) * per] for r in range(dp)]
    if max_tokens is None:
        plan = [
            [
                list(range(i, min(i + micro_batch_size, per)))
                for i in range(0, per, micro_batch_size)
            ]
            for _ in shards
        ]
        _check_multiple(len(plan[0]), multiple_of, per, "--micro-batch-size")
        return plan
    n = max(_first_fit_decreasing(s, max_tokens) for s in shards)
    n = -(-n // multiple_of) * multiple_of
    while n <= per:
        plans = [_balanced(s, n, max_tokens) for s in shards]
        if all(p is not None for p in plans):
            return plans  # type: ignore[return-value]
        n += multiple_of
    _check_multiple(n, multiple_of, per, "--max-tokens-per-gpu")
    return [[[i] for i in range(per)] for _ in shards]  # one sample each: always fits


def _check_multiple(n: int, multiple_of: int, per: int, flag: str) -> None:
    if n % multiple_of:
        raise ValueError(
            f"the interleaved pipeline schedule needs a multiple of PP={multiple_of} "
            f"micro-batches per step, but {per} samples per data-parallel rank give {n}; "
            f"change {flag} or the global batch size"
        )


def _order(lengths: list[int]) -> list[int]:
    """Longest first; ties by position (deterministic)."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _first_fit_decreasing(lengths: list[int], cap: int) -> int:
    loads: list[int] = []
    for i in _order(lengths):
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= cap:
                loads[b] += n
                break
        else:
            loads.append(n)
    return len(loads)


def _balanced(lengths: list[int], n: int, cap: int) -> list[list[int]] | None:
    """Longest first into the least-loaded of `n` bins it fits in (an over-budget sample only
    into an empty bin); None if some sample fits nowhere. Rows within a bin stay in order."""
    bins: list[list[int]] = [[] for _ in range(n)]
    loads = [0] * n
    for i in _order(lengths):
        size = lengths[i]
        fits = [b for b in range(n) if (loads[b] + size <= cap) or not bins[b]]
        if not fits:
            return None
        b = min(fits, key=lambda j: (loads[j], j))
        bins[b].append(i)
        loads[b] += size
    if any(not b for b in bins):
        return None
    return [sorted(b) for b in bins]


@dataclasses.dataclass(frozen=True, slots=True)
class RowLayout:
    """Where the samples of one micro-batch sit in the model input `[rows, width]`."""

    rows: int
    """Rows of the model input (1 when packed)."""
    width: int
    """Columns of the model input (a multiple of TP for sequence parallelism)."""
    starts: tuple[tuple[int, int], ...]
    """(row, column) of each sample's first token."""
    lengths: tuple[int, ...]
    """Tokens of each sample."""
    cu_seqlens: tuple[int, ...] | None
    """Packed only: segment bounds in the row (the samples, then a padding segment if any)."""

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None


def row_layout(
    lengths: list[int], *, packed: bool, tp: int = 1, min_width: int = 0, min_rows: int = 0
) -> RowLayout:
    """Layout of samples of `lengths`: packed back to back in one row, or one padded row each.
    The width is rounded up to a multiple of `tp` and is at least `min_width`, padded layouts
    have at least `min_rows` rows (equal shapes across expert-parallel ranks); the padding is
    a segment of its own when packed."""
    if packed:
        total = sum(lengths)
        width = _round_up(max(total, min_width), tp)
        starts = tuple((0, c) for c in _cumsum(lengths)[:-1])
        cu = _cumsum(lengths) + ([width] if width > total else [])
        return RowLayout(
            rows=1, width=width, starts=starts, lengths=tuple(lengths), cu_seqlens=tuple(cu)
        )
    width = _round_up(max(max(lengths), min_width), tp)
    starts = tuple((r, 0) for r in range(len(lengths)))
    return RowLayout(
        rows=max(len(lengths), min_rows),
        width=width,
        starts=starts,
        lengths=tuple(lengths),
        cu_seqlens=None,
    )


def shape_floor(
    plans: list[list[list[int]]], lengths: list[int], *, packed: bool
) -> list[tuple[int, int]]:
    """Per micro-batch index, the (width, rows) every DP shard's layout must reach so that all
    expert-parallel ranks exchange equally many tokens: the largest over the shards."""
    per = len(lengths) // len(plans)
    out = []
    for i in range(len(plans[0])):
        sizes = [[lengths[r * per + j] for j in plan[i]] for r, plan in enumerate(plans)]
        width = max(sum(s) if packed else max(s) for s in sizes)
        out.append((width, 1 if packed else max(len(s) for s in sizes)))
    return out


def _cumsum(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def model_input(tokens: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """`[rows, width]` token ids of right-padded `tokens` `[b, w]` (padding ids are 0)."""
    out = tokens.new_zeros(layout.rows, layout.width)
    for i, ((r, c), n) in enumerate(zip(layout.starts, layout.lengths)):
        out[r, c : c + n] = tokens[i, :n]
    return out


def position_ids(layout: RowLayout) -> torch.Tensor:
    """`[rows, width]` positions restarting at 0 in every sample (and in the padding)."""
    if not layout.packed:
        return torch.arange(layout.width).unsqueeze(0).expand(layout.rows, -1).contiguous()
    cu = layout.cu_seqlens
    return torch.cat([torch.arange(e - s) for s, e in itertools.pairwise(cu)]).unsqueeze(0)


def sample_index(layout: RowLayout, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, valid) `[b, width]`: the token-aligned value of token t of sample i (t ≥ 1) is
    per-position output `flat[src[i, t]]`, where position (r, c) of `[rows, width − 1]`
    predicts column c + 1 of row r; `valid` is False for t = 0 and padding."""
    b = len(layout.lengths)
    src = torch.zeros(b, width, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for i, ((r, c), n) in enumerate(zip(layout.starts, layout.lengths)):
        if n > 1:
            src[i, 1:n] = r * (layout.width - 1) + c + torch.arange(n - 1)
            valid[i, 1:n] = True
    return src, valid


def read_positions(
    src: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor, rows: int, width: int
) -> torch.Tensor:
    """`[rows, width − 1]` bool: the positions whose per-position value is read, those that
    `sample_index`'s (`src`, `valid`) map to a token where the token-aligned `mask` `[b, w]`
    is True (a response token's log-prob is read at the position before it)."""
    out = torch.zeros(rows * (width - 1), dtype=torch.bool)
    out[src[valid & mask.to(valid.device)]] = True
    return out.view(rows, width - 1)


def to_samples(per_position: torch.Tensor, src: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Token-aligned `[b, w]` from per-position values `[rows, width − 1]` (0 where not valid;
    differentiable)."""
    flat = per_position.reshape(-1)
    picked = flat[src.to(flat.device)]
    return torch.where(valid.to(flat.device), picked, picked.new_zeros(()))
