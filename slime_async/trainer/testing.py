"""Helpers for trainer tests and `scripts/bench_*.py` (not used in production paths).

Owns: a reference "engine" built from plain `transformers` (bf16 or fp32 sampling with
per-token log-probs and MoE routing captured by forward hooks on `Qwen3MoeTopKRouter`, in the
`[T−1, L, K]` layout `/generate` returns), and synthetic batches. Must never import the
controller, engine, rollout or data-worker parts of `slime_async`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from slime_async.contracts.batch import TrainerBatch
from slime_async.contracts.model import ModelSpec


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HFRollout:
    """Sampled continuations of equal-length prompts from an HF model."""

    tokens: torch.Tensor
    """[B, P + N] prompt + sampled tokens."""
    prompt_len: int
    """P."""
    logprobs: torch.Tensor
    """[B, N] fp32 log-probs of the sampled tokens under the sampling model/dtype."""
    routed_experts: list[np.ndarray] | None
    """Per sample `[P + N − 1, L, K]` int32 top-k ids used while sampling (MoE only)."""


def load_hf(path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def _router_hooks(model: torch.nn.Module, calls: dict[int, list[torch.Tensor]]) -> list:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    handles = []
    layer_of = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Qwen3MoeTopKRouter):
            layer_of[mod] = int(name.split("layers.")[1].split(".")[0])

    def hook(mod: torch.nn.Module, _inp: object, out: tuple[torch.Tensor, ...]) -> None:
        calls.setdefault(layer_of[mod], []).append(out[2].detach().to(torch.int64).cpu())

    for mod in layer_of:
        handles.append(mod.register_forward_hook(hook))
    return handles


@torch.no_grad()
def hf_sample(
    model: torch.nn.Module,
    spec: ModelSpec,
    prompts: torch.Tensor,
    *,
    max_new_tokens: int,
    seed: int = 0,
    temperature: float = 1.0,
) -> HFRollout:
    """Sample `max_new_tokens` per prompt (no EOS: every sample has the same length)."""
    bsz, plen = prompts.shape
    calls: dict[int, list[torch.Tensor]] = {}
    handles = _router_hooks(model, calls) if spec.is_moe else []
    torch.manual_seed(seed)
    try:
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    finally:
        for h in handles:
            h.remove()
    seq = out.sequences
    new = seq[:, plen:]
    logits = torch.stack(out.logits, 1).float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    routed = None
    if spec.is_moe:
        layers = []
        for layer in range(spec.num_layers):
            chunks = calls[layer]
            pre = chunks[0].view(bsz, plen, -1)  # prefill: batch-major [B*P, K]
            dec = [c.view(bsz, 1, -1) for c in chunks[1:]]  # one row per decode step
            layers.append(torch.cat([pre, *dec], 1))  # [B, P + N - 1, K]
        full = torch.stack(layers, 2)  # [B, P + N - 1, L, K]
        routed = [full[b].numpy().astype(np.int32) for b in range(bsz)]
    return HFRollout(tokens=seq, prompt_len=plen, logprobs=lp, routed_experts=routed)


@torch.no_grad()
def hf_teacher_forced(
    model: torch.nn.Module, spec: ModelSpec, tokens: torch.Tensor
) -> tuple[torch.Tensor, list[np.ndarray] | None]:
    """Token-aligned `[B, T]` log-probs and per-sample `[T−1, L, K]` routing of a full forward."""
    from slime_async.trainer.forward import token_logprobs

    calls: dict[int, list[torch.Tensor]] = {}
    handles = _router_hooks(model, calls) if spec.is_moe else []
    try:
        logits = model(tokens).logits
    finally:
        for h in handles:
            h.remove()
    lp, _ = token_logprobs(logits.float(), tokens)
    routed = None
    if spec.is_moe:
        bsz, t = tokens.shape
        full = torch.stack([calls[i][0].view(bsz, t, -1) for i in range(spec.num_layers)], 2)
        routed = [full[b, :-1].numpy().astype(np.int32) for b in range(bsz)]
    return lp, routed


def rollout_batch(
    ro: HFRollout, *, advantages: list[float], version: int = 0, with_routing: bool = True
) -> TrainerBatch:
    """A `TrainerBatch` from an `HFRollout` (responses trained, rollout log-probs attached)."""
    bsz = ro.tokens.shape[0]
    return TrainerBatch.from_lists(
        tokens=ro.tokens.tolist(),
        prompt_lengths=[ro.prompt_len] * bsz,
        rollout_logprobs=ro.logprobs.tolist(),
        advantages=advantages,
        versions=[version] * bsz,
        routed_experts=ro.routed_experts if with_routing else None,
    )


def random_batch(
    spec: ModelSpec,
    *,
    batch: int,
    width: int,
    prompt: int,
    seed: int = 0,
    lengths: list[int] | None = None,
) -> TrainerBatch:
    """Random tokens, alternating ±1 advantages, rollout log-probs of a uniform policy.

    `lengths` (each in (prompt, width]) gives ragged samples; default: all `width` long.
    """
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, spec.vocab_size, (batch, width), generator=g).tolist()
    lens = lengths or [width] * batch
    toks = [t[:n] for t, n in zip(toks, lens)]
    lp = -float(np.log(spec.vocab_size))
    return TrainerBatch.from_lists(
        tokens=toks,
        prompt_lengths=[prompt] * batch,
        rollout_logprobs=[[lp] * (n - prompt) for n in lens],
        advantages=[1.0 if i % 2 == 0 else -1.0 for i in range(batch)],
        versions=[0] * batch,
    )
