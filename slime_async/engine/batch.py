"""Model steps over a continuous batch: left-padded KV cache, prefill and decode forwards.

Owns: `KVBatch` (one HF `DynamicCache` for all running sequences, left-padded, with a `[B, L]`
mask of real positions; rows are merged in when sequences join and selected out when they
leave) and the two forwards the scheduler runs, `prefill` and `decode`. Every forward passes an
explicit 4-D boolean mask and explicit position ids, so a sequence sees exactly its own tokens at
its own positions whatever else is in the batch (padding changes no real row). Padded query rows
attend to themselves only, so they stay finite and never poison the cache.
Must never import the server, the scheduler or aiohttp; runs in the scheduler's worker thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache

from slime_async.engine.model import LoadedModel


@dataclasses.dataclass(kw_only=True, slots=True)
class KVBatch:
    """KV cache of the running batch. Row i belongs to the i-th running sequence."""

    cache: DynamicCache
    """Per layer keys/values `[B, kv_heads, L, head_dim]`, left-padded."""
    mask: torch.Tensor
    """`[B, L]` bool, True where the cache holds a real token."""
    rope_delta: torch.Tensor | None = None
    """Vision-language models: `[B]` int64 added to each row's next index to get its mRoPE
    position (negative after an image: its placeholders span fewer positions than tokens)."""

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def lengths(self) -> torch.Tensor:
        """Real tokens per row `[B]` (= the position id of each row's next token)."""
        return self.mask.sum(dim=1)


def _kv_of(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    extra = length - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def merge(a: KVBatch | None, b: KVBatch) -> KVBatch:
    """Append the rows of `b` after the rows of `a` (left-padding both to a common length).
    Consumes both: layer by layer the merged tensors replace `a`'s and `b`'s are dropped, so at
    most one layer is held twice (not the whole cache)."""
    if a is None or a.size == 0:
        return b
    length = max(a.mask.shape[1], b.mask.shape[1])
    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        la.keys = torch.cat([_left_pad(la.keys, length, 2), _left_pad(lb.keys, length, 2)], dim=0)
        la.values = torch.cat(
            [_left_pad(la.values, length, 2), _left_pad(lb.values, length, 2)], dim=0
        )
        lb.keys = lb.values = None
    mask = torch.cat([_left_pad(a.mask, length, 1), _left_pad(b.mask, length, 1)], dim=0)
    delta = None
    if a.rope_delta is not None or b.rope_delta is not None:
        delta = torch.cat([_delta(a), _delta(b)])
    return KVBatch(cache=a.cache, mask=mask, rope_delta=delta)


def _delta(kv: KVBatch) -> torch.Tensor:
    return kv.rope_delta if kv.rope_delta is not None else torch.zeros(kv.size, dtype=torch.long)


def select(kv: KVBatch, rows: list[int]) -> KVBatch | None:
    """Keep only `rows` (in that order); drop leading columns that are padding in every kept row.
    Consumes `kv`: layer by layer the kept rows replace the old tensors, so at most one layer is
    held twice."""
    if not rows:
        return None
    idx = torch.tensor(rows, dtype=torch.long)
    mask = kv.mask.index_select(0, idx)
    real_cols = mask.any(dim=0).nonzero()
    start = int(real_cols[0]) if real_cols.numel() else mask.shape[1]
    for layer in kv.cache.layers:
        layer.keys = layer.keys[:, :, start:].index_select(0, idx)
        layer.values = layer.values[:, :, start:].index_select(0, idx)
    delta = None if kv.rope_delta is None else kv.rope_delta.index_select(0, idx)
    return KVBatch(cache=kv.cache, mask=mask[:, start:].contiguous(), rope_delta=delta)


@dataclasses.dataclass(kw_only=True, slots=True)
class PrefillOut:
    """What one prefill forward over N new sequences returns."""

    kv: KVBatch
    """The new rows' cache."""
    last_logits: torch.Tensor
    """`[N, V]` fp32 logits at each sequence's last token (its next-token distribution)."""
    prompt_logits: list[torch.Tensor | None]
    """Per sequence, where asked for (`prompt_logits_from[i]` = a), `[P_i − 1 − a, V]` fp32
    logits at the prompt positions a..P_i − 2 (those predicting prompt tokens a + 1..)."""
    routed: list[torch.Tensor] | None
    """Per sequence int32 `[P_i, num_layers, topk]`, when capture was asked for."""


@contextlib.contextmanager
def _forward(lm: LoadedModel, *, tokens: int, capture: bool) -> Iterator[None]:
    """Context of one model forward: expert capture on/off and the model's compute mode."""
    lm.capture.active = capture
    try:
        with lm.compute(tokens):
            yield
    finally:
        lm.capture.active = False


def _heads(lm: LoadedModel) -> tuple[torch.nn.Module, torch.nn.Module]:
    return lm.model.get_decoder(), lm.model.get_output_embeddings()


@torch.no_grad()
def prefill(
    lm: LoadedModel,
    seqs: list[list[int]],
    *,
    prompt_logits_from: list[int | None],
    capture: bool,
    past: list[list[tuple[torch.Tensor, torch.Tensor]] | None] | None = None,
    images: list[Any] | None = None,
) -> PrefillOut:
    """Forward N token lists (left-padded into one batch) and build their cache.

    `past[i]`, where given, is the KV of the first `c_i` tokens of `seqs[i]` (per layer
    `[kv_heads, c_i, head_dim]`, from the prefix cache): only `seqs[i][c_i:]` is forwarded, at
    positions `c_i..`, attending to that KV. The returned rows hold past and new KV (row layout
    `[pad, past, pad, new]`, the mask marks the real columns); `routed` covers the forwarded
    tokens only. Only the hidden states that are read go through the output layer: each row's
    last (its next-token distribution) and, where `prompt_logits_from[i]` is given (a position
    of `seqs[i]` at or after its past), positions `prompt_logits_from[i]`..P_i − 2 (the
    log-probs of prompt tokens from `prompt_logits_from[i]` + 1 on). A vision-language model
    forwards embeddings with `images[i]`'s features (`engine.vision.EngineImages`, None: text
    only) at mRoPE positions (`vision.prefill_inputs`)."""
    n = len(seqs)
    plen = [0 if past is None or past[i] is None else int(past[i][0][0].shape[1]) for i in range(n)]
    new = [s[c:] for s, c in zip(seqs, plen)]
    p = max(len(s) for s in new)
    ids = torch.zeros(n, p, dtype=torch.long)
    real = torch.zeros(n, p, dtype=torch.bool)
    for i, s in enumerate(new):
        ids[i, p - len(s) :] = torch.tensor(s, dtype=torch.long)
        real[i, p - len(s) :] = True
    pos = (real.long().cumsum(dim=1) - 1).clamp(min=0) + torch.tensor(plen)[:, None]
    causal = torch.ones(p, p, dtype=torch.bool).tril()
    allowed = (causal[None] & real[:, None, :]) | torch.eye(p, dtype=torch.bool)[None]
    if max(plen):
        assert past is not None
        cache, allowed, mask = _with_past(past, plen, real, allowed)
    else:
        cache, mask = DynamicCache(), real
    decoder, head = _heads(lm)
    delta, inputs = None, {"input_ids": ids, "position_ids": pos}
    with _forward(lm, tokens=n * p, capture=capture):
        if getattr(lm, "vision", None) is not None:
            from slime_async.engine.vision import prefill_inputs

            inputs, delta = prefill_inputs(lm, seqs, plen, images or [None] * n, p)
        h = decoder(
            **inputs,
            attention_mask=allowed[:, None],
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        routed_all = lm.capture.take(n, p) if capture else None
        last_logits = head(h[:, -1]).float()
        prompt_logits: list[torch.Tensor | None] = [
            None if a is None else head(h[i, p - len(s) + a - c : p - 1]).float()
            for i, (s, a, c) in enumerate(zip(new, prompt_logits_from, plen))
        ]
    routed = (
        [routed_all[i, p - len(s) :] for i, s in enumerate(new)] if routed_all is not None else None
    )
    return PrefillOut(
        kv=KVBatch(cache=cache, mask=mask, rope_delta=delta),
        last_logits=last_logits,
        prompt_logits=prompt_logits,
        routed=routed,
    )


def _with_past(
    past: list[list[tuple[torch.Tensor, torch.Tensor]] | None],
    plen: list[int],
    real: torch.Tensor,
    allowed: torch.Tensor,
) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """(cache holding each row's past KV left-padded to the longest, attention rule with the
    past columns in front, mask of real columns) for a prefill over cached prefixes."""
    n, lp = len(plen), max(plen)
    past_real = torch.zeros(n, lp, dtype=torch.bool)
    for i, c in enumerate(plen):
        past_real[i, lp - c :] = True
    some = next(x for x in past if x is not None)
    layers = []
    for layer in range(len(some)):
        ks, vs = [], []
        ref = some[layer][0]
        for kv in past:
            if kv is None:
                shape = (ref.shape[0], lp, ref.shape[2])
                ks.append(ref.new_zeros(shape))
                vs.append(ref.new_zeros(shape))
            else:
                ks.append(_left_pad(kv[layer][0], lp, 1))
                vs.append(_left_pad(kv[layer][1], lp, 1))
        layers.append((torch.stack(ks), torch.stack(vs)))
    cache = DynamicCache(ddp_cache_data=layers)
    # a padded query row sees only itself; a real one its past and its own causal prefix
    allowed = torch.cat([past_real[:, None, :] & real[:, :, None], allowed], dim=2)
    return cache, allowed, torch.cat([past_real, real], dim=1)


def row_kv(kv: KVBatch, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `length` real tokens of `row`, per layer `[kv_heads, length, head_dim]` (copies:
    what the prefix cache stores)."""
    cols = kv.mask[row].nonzero()[:length, 0]
    return [
        (k[row].index_select(1, cols), v[row].index_select(1, cols)) for k, v in _kv_of(kv.cache)
    ]


@torch.no_grad()
def decode(
    lm: LoadedModel, kv: KVBatch, tokens: list[int], *, capture: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Feed one token per row; grows `kv` in place. Returns `(logits [B, V] fp32, routed
    [B, num_layers, topk] int32 or None)`."""
    b = kv.size
    pos = kv.lengths()[:, None]
    if kv.rope_delta is not None:  # mRoPE: all three position ids continue past the prompt
        pos = (pos + kv.rope_delta[:, None])[None].expand(3, -1, -1)
    new_mask = torch.cat([kv.mask, torch.ones(b, 1, dtype=torch.bool)], dim=1)
    decoder, head = _heads(lm)
    with _forward(lm, tokens=b, capture=capture):
        h = decoder(
            input_ids=torch.tensor(tokens, dtype=torch.long)[:, None],
            attention_mask=new_mask[:, None, None, :],
            position_ids=pos,
            past_key_values=kv.cache,
            use_cache=True,
        ).last_hidden_state
        routed = lm.capture.take(b, 1)[:, 0] if capture else None
        logits = head(h[:, 0]).float()
    kv.mask = new_mask
    return logits, routed
