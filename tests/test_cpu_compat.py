"""`slime_async.trainer.cpu_compat`: which patches apply where."""

from __future__ import annotations

import pytest


def test_the_te_names_moe_routing_reads_are_defined_on_gpus_too(monkeypatch):
    """megatron-core 0.16.1 without TransformerEngine reads `te_general_gemm` in its MoE router
    on any device (a NameError on an H200): `apply()` defines it even where CUDA is usable,
    and leaves every CPU-only patch off there."""
    from megatron.core.transformer.moe import moe_utils

    from slime_async.trainer import cpu_compat

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(cpu_compat, "cuda_available", lambda: True)
    assert cpu_compat.apply() is False  # the CPU patches stay off
    assert moe_utils.te_general_gemm is None  # the router's check reads None, not a NameError


def _in_fresh_process(code: str, timeout: int = 120) -> None:
    """Run `code` in a new Python (this one has megatron imported already); it prints 'ok'."""
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert p.stdout.strip().endswith("ok"), p.stderr[-2000:]


def test_megatron_is_imported_without_the_loggers_nothing_here_uses():
    """The trainer's and the role's actors import megatron through `import_megatron_lean`:
    wandb and torch's tensorboard writer (megatron's timers' loggers) are not loaded, ~22 MiB
    less per process, and those installed stay importable afterwards (a machine may lack
    wandb: the GPU image has none). In a fresh process (this one has megatron already)."""
    code = (
        "import importlib.util, sys\n"
        "from slime_async.trainer import cpu_compat\n"
        "there = [m for m in cpu_compat._UNUSED_BY_MEGATRON if importlib.util.find_spec(m)]\n"
        "cpu_compat.import_megatron_lean()\n"
        "from megatron.core import timers\n"
        "import slime_async.trainer.model\n"
        "assert timers.wandb is None and timers.SummaryWriter is None\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'tensorboard'))\n"
        "assert not loaded, loaded[:5]\n"
        "assert all(importlib.util.find_spec(m) for m in there), there\n"
        "print('ok')\n"
    )
    _in_fresh_process(code)


def test_megatron_is_imported_on_a_cpu_with_its_fusions_compiled_on_first_call():
    """Patch 12: on a CPU megatron's import leaves TorchDynamo unloaded (its `jit_fuser` defers
    `torch.compile` to a function's first call), `torch.compile` is torch's own again
    afterwards, and a function megatron decorates later compiles when first called, with its
    eager values. In a fresh process."""
    from slime_async.trainer import cpu_compat

    if cpu_compat.cuda_available():
        pytest.skip("a CPU-only patch")
    code = (
        "import sys, torch\n"
        "from slime_async.trainer import cpu_compat\n"
        "compile_ = torch.compile\n"
        "cpu_compat.import_megatron_lean()\n"
        "import slime_async.trainer.trainer\n"
        "from megatron.core import jit\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "assert jit.jit_fuser is cpu_compat.compile_on_first_call and torch.compile is compile_\n"
        "f = jit.jit_fuser(lambda x: torch.nn.functional.silu(x) * 2)\n"
        "x = torch.randn(5)\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "assert torch.allclose(f(x), f.__wrapped__(x)) and 'torch._dynamo' in sys.modules\n"
        "print('ok')\n"
    )
    _in_fresh_process(code, timeout=300)


def test_rope_in_one_function_equals_megatrons_math():
    """Patch 11: megatron's unfused RoPE (`_apply_rotary_pos_emb_bshd`, as a packed THD call
    reaches it) through one autograd function: `t·cos + rotate_half(t)·sin` and its input
    gradient to 1e-6 in fp32, to bf16's rounding in bf16 (fewer roundings than megatron's),
    `mscale` applied; interleaved rotation keeps megatron's own code."""
    import pytest
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    from slime_async.trainer import cpu_compat

    if cpu_compat.cuda_available():
        pytest.skip("a CPU-only patch")
    cpu_compat.apply()
    assert getattr(rope_utils._apply_rotary_pos_emb_bshd, "_slime_async_patched", False)
    g = torch.Generator().manual_seed(0)
    freqs = torch.randn(11, 1, 1, 8, generator=g).repeat(1, 1, 1, 2)  # [s, 1, 1, d]: RoPE's
    t = torch.randn(11, 1, 3, 16, generator=g)
    grad = torch.randn(11, 1, 3, 16, generator=g)

    def reference(x, mscale):
        cos, sin = torch.cos(freqs) * mscale, torch.sin(freqs) * mscale
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        return x * c + rope_utils._rotate_half(x, False) * s

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 0.05)):
        for mscale in (1.0, 0.7):
            a = t.to(dtype).clone().requires_grad_()
            b = t.to(dtype).clone().requires_grad_()
            out = rope_utils._apply_rotary_pos_emb_bshd(a, freqs, mscale=mscale)
            ref = reference(b, mscale)
            out.backward(grad.to(dtype))
            ref.backward(grad.to(dtype))
            assert (out.float() - ref.float()).abs().max() <= tol, (dtype, mscale)
            assert (a.grad.float() - b.grad.float()).abs().max() <= tol, (dtype, mscale)
    inter = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True)
    x1, x2 = t[..., ::2], t[..., 1::2]
    rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
    assert torch.allclose(inter, t * torch.cos(freqs) + rot * torch.sin(freqs), atol=1e-6)
