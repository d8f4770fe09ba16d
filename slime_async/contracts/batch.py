"""The trainer's input batch: padded `[B, T]` token-aligned tensors (prompt + response).

Owns: `TrainerBatch`, its validation, and micro-batch / data-parallel slicing. Must never
import the controller, engine, rollout or data-worker parts of `slime_async`.

Conventions (all per-token tensors are aligned with `tokens`):
* `tokens[b, :lengths[b]]` is prompt + response of sample b, right-padded to T (pad value is
  irrelevant). Column t of a per-token tensor describes token t, predicted from tokens `< t`;
  column 0 can never be trained (it has no prefix), so `loss_mask[:, 0]` must be False.
* `loss_mask[b, t]` is True for response tokens that are trained (never padding, never prompt).
* `rollout_logprobs[b, t]`: π_j^SGL(token t) from the engine (0 where not masked).
* `advantages[b, t]`: per-token advantage (broadcast the sample's scalar over its tokens).
* `token_versions[b, t]`: trainer version j whose weights sampled token t (−1 where unused).
* `routed_experts[b]`: optional engine routing of sample b, int array `[lengths[b] − 1, L, K]`
  (row t = experts chosen when token t was the *input*; L = all `num_hidden_layers`), exactly
  as `/generate` returns in `meta_info.routed_experts` (start_len 0) after reshape.

Worked example: prompt [5, 9], response [7, 3] → tokens [[5, 9, 7, 3]], lengths [4],
loss_mask [[F, F, T, T]], rollout_logprobs [[0, 0, lp(7), lp(3)]], routed_experts[0] of
shape [3, L, K] (inputs 5, 9, 7).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from slime_async.contracts.vision import ImageRefs, SampleImages


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerBatch:
    """A padded batch of B samples of width T (see module docstring for the conventions)."""

    tokens: torch.Tensor
    """[B, T] int64 token ids (prompt + response, right-padded)."""
    lengths: torch.Tensor
    """[B] int64 number of real tokens per sample."""
    loss_mask: torch.Tensor
    """[B, T] bool: trained response tokens."""
    rollout_logprobs: torch.Tensor
    """[B, T] float32: engine log-probs π_j^SGL of each token (0 where not masked)."""
    advantages: torch.Tensor
    """[B, T] float32: per-token advantages."""
    token_versions: torch.Tensor
    """[B, T] int64: version j that sampled each token (−1 where not masked)."""
    routed_experts: tuple[np.ndarray, ...] | None = None
    """Per sample `[lengths[b] − 1, L, K]` int engine routing (R3), or None."""
    behavior_logprobs: torch.Tensor | None = None
    """[B, T] float32 π_j^Meg of each token under its own version's trainer weights, computed
    off the train step (`--behavior-forward role`); NaN where not computed. None: the trainer
    computes π_j^Meg itself when its loss reads it."""
    images: tuple[SampleImages | ImageRefs | None, ...] | None = None
    """Vision-language models: each sample's images, preprocessed or by reference (None: a
    sample without), or None for a batch without any. Their placeholder tokens are prompt tokens: never in `loss_mask`."""

    def __post_init__(self) -> None:
        b, t = self.tokens.shape if self.tokens.dim() == 2 else (None, None)
        if b is None:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(self.tokens.shape)}")
        for name in (
            "loss_mask",
            "rollout_logprobs",
            "advantages",
            "token_versions",
            "behavior_logprobs",
        ):
            if getattr(self, name) is None:
                continue
            shape = tuple(getattr(self, name).shape)
            if shape != (b, t):
                raise ValueError(f"{name} has shape {shape}; expected [B, T] = {(b, t)}")
        if tuple(self.lengths.shape) != (b,):
            raise ValueError(f"lengths has shape {tuple(self.lengths.shape)}; expected ({b},)")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError("loss_mask must be a bool tensor")
        if bool(self.loss_mask[:, 0].any()):
            raise ValueError("loss_mask[:, 0] must be False: token 0 has no prefix to predict it")
        if int(self.lengths.max()) > t or int(self.lengths.min()) < 1:
            raise ValueError(f"lengths must lie in [1, T={t}]")
        pos = torch.arange(t).unsqueeze(0)
        if bool((self.loss_mask & (pos >= self.lengths.unsqueeze(1))).any()):
            raise ValueError("loss_mask marks padding positions (t >= lengths[b])")
        if self.images is not None and len(self.images) != b:
            raise ValueError(f"images has {len(self.images)} entries, not one per sample ({b})")
        if self.routed_experts is not None:
            if len(self.routed_experts) != b:
                raise ValueError(f"routed_experts has {len(self.routed_experts)} samples, not {b}")
            for i, re_ in enumerate(self.routed_experts):
                if re_.ndim != 3 or re_.shape[0] != int(self.lengths[i]) - 1:
                    raise ValueError(
                        f"routed_experts[{i}] has shape {re_.shape}; expected "
                        f"[lengths[{i}] - 1 = {int(self.lengths[i]) - 1}, num_layers, topk]"
                    )

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def select(self, idx: slice | list[int]) -> TrainerBatch:
        """Rows `idx` of the batch (micro-batch or data-parallel shard)."""
        rows = list(range(self.size))[idx] if isinstance(idx, slice) else list(idx)
        ix = torch.tensor(rows, dtype=torch.long)
        re_ = None if self.routed_experts is None else tuple(self.routed_experts[i] for i in rows)
        return TrainerBatch(
            tokens=self.tokens[ix],
            lengths=self.lengths[ix],
            loss_mask=self.loss_mask[ix],
            rollout_logprobs=self.rollout_logprobs[ix],
            advantages=self.advantages[ix],
            token_versions=self.token_versions[ix],
            routed_experts=re_,
            images=None if self.images is None else tuple(self.images[i] for i in rows),
            behavior_logprobs=None
            if self.behavior_logprobs is None
            else self.behavior_logprobs[ix],
        )

    def trimmed(self, width: int) -> TrainerBatch:
        """The first `width` columns (drop right padding); `width >= max(lengths)`."""
        if width < int(self.lengths.max()) or width > self.width:
            raise ValueError(
                f"cannot trim to width {width}: lengths reach {int(self.lengths.max())}"
            )
        if width == self.width:
            return self
        return dataclasses.replace(
            self,
            tokens=self.tokens[:, :width],
            loss_mask=self.loss_mask[:, :width],
            rollout_logprobs=self.rollout_logprobs[:, :width],
            advantages=self.advantages[:, :width],
            token_versions=self.token_versions[:, :width],
            behavior_logprobs=(
                None if self.behavior_logprobs is None else self.behavior_logprobs[:, :width]
            ),
        )

    def micro_batches(self, micro_batch_size: int) -> list[TrainerBatch]:
        """Consecutive micro-batches of at most `micro_batch_size` samples."""
        if micro_batch_size < 1:
            raise ValueError("micro_batch_size must be >= 1")
        return [
            self.select(slice(i, i + micro_batch_size))
            for i in range(0, self.size, micro_batch_size)
        ]

    def dp_shard(self, rank: int, size: int) -> TrainerBatch:
        """This data-parallel rank's contiguous share (B must be divisible by `size`)."""
        if self.size % size:
            raise ValueError(
                f"batch size {self.size} is not divisible by the data-parallel size {size}; "
                "make the global batch a multiple of DP"
            )
        n = self.size // size
        return self.select(slice(rank * n, (rank + 1) * n))

    @staticmethod
    def from_lists(
        *,
        tokens: list[list[int]],
        prompt_lengths: list[int],
        rollout_logprobs: list[list[float]],
        advantages: list[float],
        versions: list[list[int]] | list[int],
        routed_experts: list[np.ndarray] | None = None,
        pad_id: int = 0,
        pad_to_multiple: int = 1,
        images: list[SampleImages | ImageRefs | None] | None = None,
    ) -> TrainerBatch:
        """Build from per-sample lists (response log-probs/versions cover the response only)."""
        b = len(tokens)
        t = max(len(x) for x in tokens)
        t = -(-t // pad_to_multiple) * pad_to_multiple
        tok = torch.full((b, t), pad_id, dtype=torch.long)
        mask = torch.zeros((b, t), dtype=torch.bool)
        lp = torch.zeros((b, t))
        adv = torch.zeros((b, t))
        ver = torch.full((b, t), -1, dtype=torch.long)
        for i, seq in enumerate(tokens):
            p, n = prompt_lengths[i], len(seq)
            if not 1 <= p < n + 1:
                raise ValueError(f"sample {i}: prompt length {p} must be in [1, {n}]")
            if len(rollout_logprobs[i]) != n - p:
                raise ValueError(
                    f"sample {i}: {len(rollout_logprobs[i])} log-probs for {n - p} tokens"
                )
            tok[i, :n] = torch.tensor(seq)
            mask[i, p:n] = True
            lp[i, p:n] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
            adv[i, p:n] = float(advantages[i])
            v = versions[i]
            ver[i, p:n] = torch.tensor(v) if isinstance(v, list) else int(v)
        return TrainerBatch(
            tokens=tok,
            lengths=torch.tensor([len(x) for x in tokens], dtype=torch.long),
            loss_mask=mask,
            rollout_logprobs=lp,
            advantages=adv,
            token_versions=ver,
            routed_experts=None if routed_experts is None else tuple(routed_experts),
            images=None if images is None else tuple(images),
        )
