"""The chunked log-prob head (`slime_async/trainer/lm_head.py`) against the full-vocabulary
path: values and gradients within 1e-6 in fp32, whole vocabulary, split over two real gloo
ranks (TP = 2), and inside the trainer (a train step's updated weights)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from slime_async.trainer.lm_head import chunked_logprobs

pytestmark = pytest.mark.timeout(180)
torch.set_num_threads(1)

N, H, V, T = 37, 16, 101, 0.7


def _inputs(seed: int = 0, v: int = V) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g) * 0.5  # logits of std ~3, as a trained LM
    weight = torch.randn(v, H, generator=g)
    targets = torch.randint(0, v, (N,), generator=g)
    return hidden, weight, targets


def _full(hidden, weight, targets, temperature=T):
    logp = F.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _close(a: torch.Tensor, b: torch.Tensor, *, grad: bool = False) -> bool:
    """Values within 1e-6 (absolute, or relative: one fp32 ulp of a log-prob near -17);
    gradients, sums over the vocabulary in another order, within 1e-6 of their largest entry."""
    if grad:
        return float((a - b).abs().max()) <= 1e-6 * max(1.0, float(b.abs().max()))
    return torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def _grads(fn, hidden, weight, targets, g_lp, g_ent):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = fn(h, w, targets)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize(
    "chunk,block", [(1, None), (5, None), (N, None), (1000, None), (5, 7), (N, 32), (N, 100)]
)
def test_values_and_gradients_equal_the_full_vocabulary_path(chunk, block):
    """Whole-vocabulary chunks and tiles of `block` vocabulary rows (the running max rescaled
    across blocks, a last block shorter than the others)."""
    hidden, weight, targets = _inputs()
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    ref = _grads(_full, hidden, weight, targets, g_lp, g_ent)
    got = _grads(
        lambda h, w, t: chunked_logprobs(
            h, w, t, temperature=T, chunk_tokens=chunk, vocab_block=block
        ),
        hidden,
        weight,
        targets,
        g_lp,
        g_ent,
    )
    for name, a, b in zip(("log-prob", "entropy", "d hidden", "d weight"), got, ref):
        assert _close(a, b, grad=name.startswith("d ")), (name, float((a - b).abs().max()))


def test_only_the_log_prob_gradient_when_entropy_is_unused():
    hidden, weight, targets = _inputs(seed=2)
    h = hidden.clone().requires_grad_()
    lp, _ = chunked_logprobs(h, weight, targets, chunk_tokens=4)
    lp.sum().backward()
    h2 = hidden.clone().requires_grad_()
    _full(h2, weight, targets, 1.0)[0].sum().backward()
    assert _close(h.grad, h2.grad, grad=True)


@pytest.mark.parametrize(
    "chunk,rows,block", [(5, 4096, None), (1000, 4096, None), (5, 7, None), (N, 5, 16)]
)
def test_the_weight_gradient_goes_into_the_gradient_buffer(chunk, rows, block, monkeypatch):
    """A weight with megatron's fp32 gradient buffer (`main_grad`, as DDP gives it): the head's
    weight gradient is added there, tile by tile and `rows` vocabulary rows at a time, onto
    what it held, and autograd gets none (no `[V, h]` gradient held until the tied embedding's
    joins it)."""
    from slime_async.trainer import lm_head

    monkeypatch.setattr(lm_head, "WGRAD_ROWS", rows)
    hidden, weight, targets = _inputs(seed=5)
    g = torch.Generator().manual_seed(6)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    ref = _grads(_full, hidden, weight, targets, g_lp, g_ent)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    earlier = torch.randn(weight.shape, generator=g)  # an earlier micro-batch's gradient
    w.main_grad = earlier.clone()
    lp, ent = chunked_logprobs(h, w, targets, temperature=T, chunk_tokens=chunk, vocab_block=block)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert w.grad is None
    assert _close(w.main_grad - earlier, ref[3], grad=True)
    assert _close(h.grad, ref[2], grad=True)


def test_the_default_tiles():
    """A CPU: up to `TILE_TOKENS` tokens a chunk, evenly split, by vocabulary blocks that keep a
    tile within `CHUNK_ELEMENTS` logits, in multiples of `BLOCK_ALIGN` rows; a given chunk is
    kept. A GPU: whole-vocabulary chunks."""
    from slime_async.trainer.lm_head import (
        BLOCK_ALIGN,
        CHUNK_ELEMENTS,
        CHUNK_ELEMENTS_GPU,
        TILE_TOKENS,
        tiling,
    )

    for tokens, v in ((1307, 49152), (5000, 49152), (40, 151936), (1, 101), (2049, 32000)):
        chunk, block = tiling(tokens, v)
        assert chunk <= TILE_TOKENS and -(-tokens // chunk) == -(-tokens // TILE_TOKENS)
        assert block == v or (block % BLOCK_ALIGN == 0 and chunk * block <= CHUNK_ELEMENTS)
    assert tiling(5000, 49152) == (1667, 576)
    assert tiling(0, 49152) == (1, 49152)  # no tokens read: one empty chunk
    assert tiling(1307, 49152, 85) == (85, 12288)
    assert tiling(1307, 49152, device="cuda") == (CHUNK_ELEMENTS_GPU // 49152, 49152)


def test_no_tokens():
    """A micro-batch none of whose positions is read: empty log-probs, zero gradients."""
    _, weight, _ = _inputs()
    h = torch.zeros(0, H, requires_grad=True)
    w = weight.clone().requires_grad_()
    lp, ent = chunked_logprobs(h, w, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, H) and not w.grad.any()


def test_bad_shapes_are_refused():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="expected hidden"):
        chunked_logprobs(hidden[None], weight, targets)


def _tp_rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        hidden, weight, targets = _inputs(seed=3, v=2 * 50)
        shard = weight[rank * 50 : (rank + 1) * 50]
        g = torch.Generator().manual_seed(4)
        g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
        h = hidden.clone().requires_grad_()
        w = shard.clone().requires_grad_()
        lp, ent = chunked_logprobs(  # blocks of 16 rows: 16, 16, 16, 2 of the 50
            h, w, targets, temperature=T, chunk_tokens=6, vocab_block=16, group=dist.group.WORLD
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        g_h = h.grad.clone()
        dist.all_reduce(g_h)  # what the sequence-parallel gather's backward does
        out[rank] = (lp.detach(), ent.detach(), g_h, w.grad)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_over_two_ranks_equals_the_whole_vocabulary():
    from slime_async.trainer.parallel import free_port

    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_tp_rank, args=(free_port(), out), nprocs=2)
        res = dict(out)
    hidden, weight, targets = _inputs(seed=3, v=100)
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    lp, ent, g_h, g_w = _grads(_full, hidden, weight, targets, g_lp, g_ent)
    for r in (0, 1):
        lp_r, ent_r, g_h_r, g_w_r = res[r]
        assert _close(lp_r, lp) and _close(ent_r, ent)
        assert _close(g_h_r, g_h, grad=True)
        assert _close(g_w_r, g_w[r * 50 : (r + 1) * 50], grad=True)


@pytest.mark.parametrize("tied", [False, True])
def test_trainer_chunked_head_equals_the_full_logits_path(tied):
    """Same log-probs, entropies and gradients with `--logits-chunk-tokens 0` (the
    `[tokens, V]` tensor) and with chunks of 3 tokens (a packed micro-batch spans many; the
    head's weight gradient written into the gradient buffer), with the output weight its own
    or the embedding's (tied: the embedding's gradient still reaches the buffer through DDP).
    A dense model (megatron-core's MoE router needs TransformerEngine on a GPU)."""
    from slime_async.contracts.model import ModelSpec
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    spec = ModelSpec(family="qwen3", num_layers=2, tie_word_embeddings=tied)
    batch = random_batch(spec, batch=4, width=14, prompt=4, seed=0)
    results = []
    for chunk in (0, 3):
        cfg = TrainerConfig(lr=1e-2, micro_batch_size=2, seed=3, logits_chunk_tokens=chunk)
        tr = MegatronTrainer(cfg, spec)
        lp, ent = tr.compute_logprobs(batch)
        tr.train_step(batch)
        # the step's gradients (megatron DDP's buffers; an Adam update would amplify rounding
        # in near-zero gradients into ±lr)
        params = {n: p.main_grad.detach().clone() for n, p in tr.model.named_parameters()}
        results.append((lp, ent, params))
    (lp0, ent0, p0), (lp1, ent1, p1) = results
    assert _close(lp0, lp1) and _close(ent0, ent1)
    for n in p0:
        assert _close(p1[n], p0[n], grad=True), (n, float((p1[n] - p0[n]).abs().max()))
