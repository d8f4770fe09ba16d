"""The input embedding's gradient added straight into megatron's fp32 gradient buffer.

Owns: `embedding_lookup` (an autograd function) and `install`, which makes a built model's
word embedding (megatron's `VocabParallelEmbedding`, not split over TP) use it (the instance's
class is swapped: same parameter, same name). The forward is the same row lookup
(`F.embedding`, bitwise megatron's). The backward adds each token's output gradient into its
row of the weight's fp32 `main_grad` (`index_add_`; megatron's DDP would otherwise get a dense
`[V, h]` gradient in the weight's dtype from autograd and add it into that buffer, which
under bf16 also makes an fp32 copy of it: ~0.16 GiB at SmolLM2's shapes at the backward's
end), and autograd gets none for the weight, as the chunked head does for a tied output weight
(`lm_head.py`). Equal up to float rounding: repeated tokens are summed in fp32 instead of in
the weight's dtype. A weight without a buffer (before DDP wraps it), TP > 1 or no gradient:
megatron's own forward. Must never import anything from `slime_async` outside
`slime_async.trainer`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.main_grad = weight.main_grad
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple:  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        main = ctx.main_grad
        main.index_add_(0, ids.reshape(-1), g.reshape(-1, g.shape[-1]).to(main.dtype))
        return None, None


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of `weight` (which has a `main_grad`); see the module docstring."""
    return _Lookup.apply(ids, weight)


def _embedding_class() -> type:
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    class MainGradEmbedding(VocabParallelEmbedding):
        """megatron's embedding whose gradient goes into the fp32 buffer (installed by
        `install`)."""

        def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            w = self.weight
            if (
                getattr(w, "main_grad", None) is None
                or self.tp_group.size() > 1
                or self.reduce_scatter_embeddings
                or not (w.requires_grad and torch.is_grad_enabled())
            ):
                return super().forward(input_)
            return embedding_lookup(input_, w)

    return MainGradEmbedding


def install(model: torch.nn.Module) -> int:
    """Swap `model`'s word embeddings (megatron's `VocabParallelEmbedding`) to the class above;
    returns how many."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    cls, count = None, 0
    for mod in model.modules():
        if type(mod) is VocabParallelEmbedding:
            cls = cls or _embedding_class()
            mod.__class__ = cls
            count += 1
    return count
