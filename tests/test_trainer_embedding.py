"""The input embedding's gradient straight into megatron's fp32 buffer
(`slime_async/trainer/embedding.py`) and megatron's CPU `multi_tensor_scale` without its
temporary (`cpu_compat`, patch 10): the same numbers as megatron's own paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slime_async.trainer.embedding import embedding_lookup

pytestmark = pytest.mark.timeout(180)
torch.set_num_threads(1)


def test_the_lookup_is_the_rows_and_its_gradient_lands_in_the_buffer() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=g)
    ids = torch.tensor([[3, 7, 3, 49], [0, 7, 7, 12]])  # repeated tokens sum their gradients
    upstream = torch.randn(2, 4, 8, generator=g)
    ref_w = weight.clone().requires_grad_()
    ref = F.embedding(ids, ref_w)
    (ref * upstream).sum().backward()
    w = weight.clone().requires_grad_()
    earlier = torch.randn(weight.shape, generator=g)  # an earlier micro-batch's gradient
    w.main_grad = earlier.clone()
    out = embedding_lookup(ids, w)
    assert torch.equal(out, ref)
    (out * upstream).sum().backward()
    assert w.grad is None
    torch.testing.assert_close(w.main_grad - earlier, ref_w.grad, rtol=0, atol=1e-6)


def _step_grads(monkeypatch, *, installed: bool) -> tuple[str, dict[str, torch.Tensor]]:
    from slime_async.contracts.model import ModelSpec
    from slime_async.trainer import embedding
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    if not installed:
        monkeypatch.setattr(embedding, "install", lambda model: 0)
    spec = ModelSpec(family="qwen3", num_layers=2, tie_word_embeddings=False)
    tr = MegatronTrainer(TrainerConfig(lr=1e-2, micro_batch_size=2, seed=3), spec)
    tr.train_step(random_batch(spec, batch=4, width=14, prompt=4, seed=0))
    cls = next(
        type(m).__name__ for n, m in tr.model.named_modules() if n.endswith("word_embeddings")
    )
    return cls, {n: p.main_grad.detach().clone() for n, p in tr.model.named_parameters()}


def test_a_train_steps_gradients_equal_megatrons_embedding_path(monkeypatch) -> None:
    cls, grads = _step_grads(monkeypatch, installed=True)
    ref_cls, ref = _step_grads(monkeypatch, installed=False)
    assert (cls, ref_cls) == ("MainGradEmbedding", "VocabParallelEmbedding")
    assert grads.keys() == ref.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_multi_tensor_scale_writes_megatrons_values_without_a_copy() -> None:
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import local_multi_tensor_scale

    from slime_async.trainer import cpu_compat

    cpu_compat.apply()
    assert clip_grads.multi_tensor_scale_impl is cpu_compat._scale_into
    assert optimizer.multi_tensor_scale_impl is cpu_compat._scale_into
    g = torch.Generator().manual_seed(1)
    src = [torch.randn(33, 5, generator=g), torch.randn(7, generator=g)]
    for dtype in (torch.float32, torch.bfloat16):  # clipping in place; main weights -> model's
        ref = [torch.empty_like(s, dtype=dtype) for s in src]
        out = [torch.empty_like(s, dtype=dtype) for s in src]
        local_multi_tensor_scale(0, None, [src, ref], 0.37)
        cpu_compat._scale_into(0, None, [src, out], 0.37)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
    inplace = [s.clone() for s in src]
    cpu_compat._scale_into(0, None, [inplace, inplace], 0.5)
    assert all(torch.equal(a, s * 0.5) for a, s in zip(inplace, src))
