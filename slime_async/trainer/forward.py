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
    logits: torch.Tensor | Logits, input_ids: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position `[R, W − 1]` log-probs and entropies of `[R, W, V]` logits: position c of
    row r scores `input_ids[r, c + 1]` (across a packed sample boundary the value is
    meaningless and never read; see `packing.sample_index`). fp32 math. Not-yet-multiplied
    `Logits` go through `lm_head.chunked_logprobs` (no `[R, W, V]` tensor), unless their
    `chunk_tokens` is 0."""
    if isinstance(logits, Logits):
        if logits.chunk_tokens == 0:
            return position_logprobs(logits.full(), input_ids, temperature=temperature)
        h = logits.hidden[:, :-1]
        r, w = h.shape[:2]
        lp, ent = chunked_logprobs(
            h.reshape(r * w, -1),
            logits.weight,
            input_ids[:, 1:].reshape(-1),
            temperature=temperature,
            chunk_tokens=logits.chunk_tokens,
            group=logits.group,
        )
        return lp.view(r, w), ent.view(r, w)
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    tgt = input_ids[:, 1:].to(logp.device).unsqueeze(-1)
    return logp.gather(-1, tgt).squeeze(-1), -(logp.exp() * logp).sum(-1)
