"""Per-token log-probs and entropy from a megatron GPTModel forward (pure tensor math + call).

Owns: running the model on `[B, T]` tokens (padding T for sequence parallelism) and turning
logits into token-aligned log-probs/entropy (from the model's hidden states and output weight,
chunked, when the model returns them: `lm_head.py`). Must never import the controller, engine,
rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime_async.trainer import lm_head
from slime_async.trainer.lm_head import Logits, chunked_logprobs


def padded_width(width: int, tp: int) -> int:
    """Sequence length fed to megatron: a multiple of `tp` (sequence parallelism)."""
    return -(-width // tp) * tp


def model_logits(model: torch.nn.Module, tokens: torch.Tensor, *, tp: int = 1) -> torch.Tensor:
    """`[B, T, V]` logits (full vocabulary) for right-padded `tokens` `[B, T]`."""
    b, t = tokens.shape
    tpad = padded_width(t, tp)
    device = next(model.parameters()).device
    ids = tokens.to(device)
    if tpad != t:
        ids = torch.cat([ids, ids.new_zeros(b, tpad - t)], dim=1)
    pos = torch.arange(tpad, device=device).unsqueeze(0).expand(b, -1)
    logits = model(ids, pos, attention_mask=None)
    if lm_head.returns_hidden(model):
        logits = lm_head.full_logits(logits, lm_head.output_weight(model), lm_head.tp_group())
    return logits[:, :t]


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned `[B, T]` log-probs and entropies from `[B, T, V]` logits.

    Column t is log π(tokens[:, t] | tokens[:, :t]) (computed from logits at t−1); column 0
    is 0. Entropy column t is the entropy of that same next-token distribution. fp32 math.
    """
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    tgt = tokens[:, 1:].to(logp.device).unsqueeze(-1)
    lp = logp.gather(-1, tgt).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


def position_logprobs(
    logits: torch.Tensor | Logits,
    input_ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    read: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position `[R, W − 1]` log-probs and entropies of `[R, W, V]` logits: position c of
    row r scores `input_ids[r, c + 1]` (across a packed sample boundary the value is
    meaningless and never read; see `packing.sample_index`). fp32 math. Not-yet-multiplied
    `Logits` go through `lm_head.chunked_logprobs` (no `[R, W, V]` tensor), unless their
    `chunk_tokens` is 0.

    `read` (`[R, W − 1]` bool, `MicroBatch.read`): only those positions go through the head
    (the hidden states of the others, e.g. every prompt position but the last, are never
    multiplied by the output weight); the others are 0. None: every position."""
    r, w = input_ids.shape[0], input_ids.shape[1] - 1
    targets = input_ids[:, 1:].reshape(-1)
    idx = None if read is None else read.reshape(-1).nonzero().squeeze(-1)
    if idx is not None:
        targets = targets[idx]
    if isinstance(logits, Logits):
        hidden = _positions(logits.hidden, idx)
        if logits.chunk_tokens == 0:
            lp, ent = _plain(
                lm_head.full_logits(hidden, logits.weight, logits.group), targets, temperature
            )
        else:
            lp, ent = chunked_logprobs(
                hidden,
                logits.weight,
                targets,
                temperature=temperature,
                chunk_tokens=logits.chunk_tokens,
                group=logits.group,
            )
    else:
        lp, ent = _plain(_positions(logits, idx), targets, temperature)
    if idx is not None:
        lp, ent = _scatter(lp, idx, r * w), _scatter(ent, idx, r * w)
    return lp.view(r, w), ent.view(r, w)


def _positions(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """`[n, d]` rows of `x` `[R, W, d]` at the flat positions `idx` of `[R, W − 1]` (every
    position when None): the last column of each row predicts nothing."""
    r, w, d = x.shape
    if idx is None:
        return x[:, :-1].reshape(r * (w - 1), d)
    rows = idx.to(x.device)
    return x.reshape(r * w, d).index_select(0, rows + rows // max(w - 1, 1))


def _plain(z: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple:
    """(log-probs, entropies) `[n]` of `targets` under `[n, V]` logits (the whole tensor)."""
    logp = F.log_softmax(z.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.to(logp.device)[:, None].long()).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def _scatter(values: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """`[n]`: `values` at `idx`, 0 elsewhere (differentiable in `values`)."""
    return values.new_zeros(n).index_copy(0, idx.to(values.device), values)
