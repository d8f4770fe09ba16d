"""The fused CPU kernels (`slime_async/trainer/fused.py`, compiled by torch's Inductor) against
the eager autograd functions they replace: each kernel within a rounding of the eager one,
through the same autograd entry points the model calls; a train step with them on against one
with them off; a new token count that does not recompile; no compiler, a clear refusal."""

from __future__ import annotations

import pytest
import torch

from slime_async.host import cpp_compiler
from slime_async.trainer import fused

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(cpp_compiler() is None, reason="Inductor needs a C++ compiler"),
]

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}
"""Within one rounding of the output's dtype (bf16 has 8 significant bits)."""


@pytest.fixture(autouse=True)
def _eager_after():
    yield
    fused.install(False)


def _both(fn, *inputs: torch.Tensor, grad: torch.Tensor) -> list:
    """(output, input gradients) of `fn` eager, then fused."""
    runs = []
    for on in (False, True):
        fused.install(on)
        xs = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*xs)
        out.backward(grad)
        runs.append((out.detach(), [x.grad for x in xs if x.grad is not None]))
    return runs


def _calls() -> int:
    info = fused.compiled.cache_info()
    return info.hits + info.misses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_kernel_is_the_eager_op_within_a_rounding(dtype):
    from slime_async.trainer.cpu_compat import _Rope
    from slime_async.trainer.norm import rms_norm
    from slime_async.trainer.swiglu import swiglu

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 1, 64, generator=g) * 3).to(dtype)
    w = torch.rand(64, generator=g) + 0.5
    y = (torch.randn(37, 1, 2 * 96, generator=g) * 3).to(dtype)
    q = torch.randn(37, 1, 3, 16, generator=g).to(dtype)
    ang = torch.rand(37, 1, 1, 16, generator=g) * 6
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    before = _calls()
    cases = {
        "norm": _both(lambda a, b: rms_norm(a, b, 1e-6), x, w, grad=torch.randn_like(x)),
        "swiglu": _both(swiglu, y, grad=torch.randn(37, 1, 96, generator=g).to(dtype)),
        "rope": _both(lambda t: _Rope.apply(t, cos, sin), q, grad=torch.randn_like(q)),
    }
    assert _calls() == before + 6  # each forward and backward went through a fused kernel
    for name, ((out_e, grads_e), (out_f, grads_f)) in cases.items():
        assert out_f.dtype == out_e.dtype and len(grads_f) == len(grads_e), name
        torch.testing.assert_close(out_f, out_e, **TOL[dtype], msg=name)
        for ge, gf in zip(grads_e, grads_f, strict=True):
            assert gf.dtype == ge.dtype, name
            torch.testing.assert_close(gf, ge, **TOL[dtype], msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_heads_tiles_are_the_eager_heads_within_a_rounding(dtype, temperature):
    """The head's softmax statistics and its tiles' gradient, fused: log-probs, entropies and the
    gradients of the hidden states and the weight over several chunks and vocabulary blocks
    (each block's running max rescaled), against the eager head."""
    from slime_async.trainer.lm_head import chunked_logprobs

    g = torch.Generator().manual_seed(1)
    hidden = (torch.randn(29, 32, generator=g) * 2).to(dtype)
    weight = torch.randn(200, 32, generator=g).to(dtype)
    targets = torch.randint(0, 200, (29,), generator=g)
    g_lp, g_ent = torch.randn(29, generator=g), torch.randn(29, generator=g)
    runs, before = [], _calls()
    for on in (False, True):
        fused.install(on)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = chunked_logprobs(
            h, w, targets, temperature=temperature, chunk_tokens=8, vocab_block=64
        )
        torch.autograd.backward((lp, ent), (g_lp, g_ent))
        runs.append((lp.detach(), ent.detach(), h.grad, w.grad))
    assert _calls() > before + 4  # the fused tiles ran, forward and backward
    tol = TOL[dtype] if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, eager, fast in zip(("lp", "ent", "dh", "dw"), *runs, strict=True):
        torch.testing.assert_close(fast, eager, **tol, msg=name)


def test_a_train_step_with_the_kernels_is_the_eager_step_and_a_new_length_compiles_nothing():
    """A small dense model (norms, SwiGLU, RoPE), bf16: the fused step's log-probs and fp32
    gradient buffers match the eager step's to bf16 rounding; a batch of another token count
    afterwards compiles no new graph (the kernels' shapes are symbolic)."""
    from torch._dynamo.utils import counters

    from slime_async.contracts.model import ModelSpec
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    spec = ModelSpec(family="qwen3", num_layers=2)
    batch = random_batch(spec, batch=4, width=14, prompt=4, seed=0)
    results = []
    for on in (False, True):
        cfg = TrainerConfig(lr=1e-2, micro_batch_size=2, seed=3, bf16=True, cpu_fused_kernels=on)
        tr = MegatronTrainer(cfg, spec)
        assert fused.active(torch.zeros(1)) is on
        lp, _ = tr.compute_logprobs(batch)
        tr.train_step(batch)
        grads = {n: p.main_grad.detach().clone() for n, p in tr.model.named_parameters()}
        results.append((lp, grads))
    (lp_e, g_e), (lp_f, g_f) = results
    done = ~lp_e.isnan()
    assert done.any() and torch.equal(done, ~lp_f.isnan())
    torch.testing.assert_close(lp_f[done], lp_e[done], rtol=0, atol=0.05)
    assert g_e.keys() == g_f.keys()
    for n in g_e:
        scale = g_e[n].abs().max().item() or 1.0
        torch.testing.assert_close(g_f[n], g_e[n], rtol=0, atol=0.05 * scale, msg=n)
    graphs = counters["stats"]["unique_graphs"]
    tr.train_step(random_batch(spec, batch=3, width=23, prompt=5, seed=1))
    assert counters["stats"]["unique_graphs"] == graphs


def test_switched_on_without_a_compiler_is_refused_with_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert cpp_compiler() is None
    with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler .* --no-cpu-fused-kernels"):
        fused.install(True)
    assert not fused.active(torch.zeros(1))
