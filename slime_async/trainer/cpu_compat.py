"""CPU compatibility shim for megatron-core 0.16.1 (the ONLY place that patches Megatron/torch).

Owns: the handful of patches that let megatron-core run without CUDA (see
docs/cpu.md, "megatron-core without CUDA"). Every patch but one (5) is a no-op when CUDA is
available, and `apply()` is idempotent. Must never import anything from the rest of `slime_async`
but `trainer.fused` (RoPE's compiled kernel; it imports only `host`, which imports nothing).

Patches (CPU only):
1. `torch.cuda.current_device()` returns "cpu" (RoPE inv_freq, router weight moves).
2. Megatron's RNG tracker uses the CPU generator (`_get/_set_cuda_rng_state`,
   `torch.cuda.get_rng_state/manual_seed/...`), so `model_parallel_cuda_manual_seed` works.
3. `torch.cuda.synchronize` / `current_stream` become no-ops.
4. Causal-mask helpers hard-coded to `device="cuda"` build on CPU instead.
5. megatron-core 0.16.1 without TransformerEngine references undefined TE names in
   `moe_utils` (`te_general_gemm`, `fused_*`): define them as None. The one patch that also
   applies with CUDA: an MoE router on a GPU without TransformerEngine hits the same names
   (a NameError in `router_gating_linear`, seen on an H200).
6. `WrappedTorchNorm` refuses sequence parallelism: build `torch.nn.RMSNorm` anyway and tag its
   parameters `sequence_parallel=True` so their grads are all-reduced over TP.
7. `cuda_literals_on_cpu()`: a context (a `TorchFunctionMode`) for megatron's DDP, optimizers and
   schedules, which hold `torch.tensor(..., device="cuda")` literals, `.cuda()` calls and
   `param.type() == "torch.cuda.FloatTensor"` checks: devices are rewritten to CPU and `type()`
   reports the CUDA name. Entered only around those calls; `model_code()` suspends it inside a
   forward (so model ops pay no per-op Python overhead).
8. `LinearWithFrozenWeight.backward` (the input gradient of a linear layer whose weight is
   frozen: every base projection under LoRA) multiplies `[s, b, n] @ [n, k]` as one 2-D GEMM;
   torch's CPU matmul ran this 3-D product with b = 1 ~20x slower (a frozen SmolLM2 layer's
   backward took seconds instead of a tenth), which made a LoRA step slower than full training.
9. `import_megatron_lean()`: `import megatron.core` imports wandb and torch's tensorboard writer
   (megatron's timers can log to them; nothing here does): ~22 MiB of Python objects in every
   process that imports megatron (measured RSS). The trainer's and the role's actors import
   megatron first through it, with those two hidden; they stay importable afterwards (a
   plugin that imports wandb gets it), only megatron's timers hold None for them.
10. megatron's CPU `multi_tensor_scale` (gradient clipping, and the optimizer's copy of the fp32
   main weights into the model's) computes `src * scale` into a new tensor and copies it:
   a temporary the size of each parameter (the embedding's 0.1 GiB in fp32 on SmolLM2, the
   trainer's peak at the clip). It now writes the product into the destination directly
   (the same values: the product in the inputs' dtype, rounded once to the destination's).
11. megatron's unfused RoPE (`rope_utils._apply_rotary_pos_emb_bshd`, also under THD packing)
   computes `t·cos + rotate_half(t)·sin` with `rotate_half` a `cat` and the result another `cat`
   with the (empty) unrotated part: about seven passes over q and k forward and more in
   autograd's backward. For the whole head dimension rotated, not interleaved and not MLA, it
   is one autograd function writing each half once (`t₁·c₁ − t₂·s₁`, `t₂·c₂ + t₁·s₂`, the
   backward the adjoint `g₁·c₁ + g₂·s₂`, `g₂·c₂ − g₁·s₁`): the same math, rounded once per
   half instead of after each product and the sum (`tests/test_cpu_compat.py`); with
   `--cpu-fused-kernels` the same function runs `fused.rotate` (compiled, fp32 inside).
12. `import_megatron_lean()` on a CPU: megatron decorates its fused kernels with `jit_fuser`,
   `torch.compile` on this torch, and each decoration imports TorchDynamo: 68 MiB of anonymous
   memory in every process that imports megatron (measured), though a dense model's CPU step
   calls none of them (Dynamo's counters stay empty over a train step). On a CPU the
   decoration is deferred: `jit_fuser` wraps each function so that its first call compiles
   it with `torch.compile`, as the decoration would have (the tiny MoE's step calls one).
   `torch.compile` itself is untouched afterwards; a GPU keeps megatron's own decoration.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily

from slime_async.trainer import fused

_LOCK = threading.Lock()
_APPLIED = False
_TORCH_COMPILE = torch.compile


def cuda_available() -> bool:
    """True when a CUDA device is usable (then every patch here is skipped)."""
    return torch.cuda.is_available()


_UNUSED_BY_MEGATRON = ("wandb", "torch.utils.tensorboard")
"""Modules `megatron.core`'s import pulls in (its timers' loggers) that no part of this project
uses in the processes that import megatron."""


def import_megatron_lean() -> None:
    """Import `megatron.core` without `_UNUSED_BY_MEGATRON` (patch 9): each is hidden from the
    import (megatron falls back to None for it), then importable again; on a CPU its fused
    kernels compiled on first call, not at import (patch 12). A no-op when megatron is imported
    already, or a hidden module was imported before (it is then left alone)."""
    import sys

    if "megatron.core" in sys.modules:
        return
    hidden = [m for m in _UNUSED_BY_MEGATRON if m not in sys.modules]
    for m in hidden:
        sys.modules[m] = None  # type: ignore[assignment]  # `import m` raises ImportError
    lazy = not cuda_available()
    compile_ = torch.compile
    if lazy:  # patch 12: megatron's `jit_fuser` is bound to this at its import
        torch.compile = compile_on_first_call  # type: ignore[assignment]
    try:
        import megatron.core  # noqa: F401
        from megatron.core import jit

        if lazy:  # what megatron's modules imported later decorate with
            jit.jit_fuser = compile_on_first_call
    finally:
        torch.compile = compile_
        for m in hidden:
            if sys.modules.get(m, 0) is None:
                del sys.modules[m]


def compile_on_first_call(model: Callable | None = None, **options: object) -> Callable:
    """`torch.compile` in both call forms (`compile(f, ...)`, `compile(...)(f)`), deferred: the
    returned function compiles `model` on its first call (patch 12)."""
    if model is None:
        return functools.partial(compile_on_first_call, **options)
    compiled: list[Callable] = []

    @functools.wraps(model)
    def run(*args: object, **kwargs: object) -> object:
        if not compiled:
            compiled.append(_TORCH_COMPILE(model, **options))
        return compiled[0](*args, **kwargs)

    return run


def apply() -> bool:
    """Apply all CPU patches once; returns True if patches are active (no CUDA)."""
    global _APPLIED
    _patch_moe_utils()  # a megatron-core bug without TransformerEngine, on GPUs too
    if cuda_available():
        return False
    with _LOCK:
        if _APPLIED:
            return True
        _patch_torch_cuda()
        _patch_rng()
        _patch_masks()
        _patch_moe_utils()
        _patch_torch_norm()
        _patch_frozen_linear()
        _patch_multi_tensor_scale()
        _patch_rope()
        _APPLIED = True
    return True


def _scale_into(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list, scale: float) -> None:
    """`dst = src · scale` for each pair of `tensor_lists` (amp_C's `multi_tensor_scale`
    signature), written into `dst` (in place when it is `src`): no temporary."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1], strict=True):
        torch.mul(src, scale, out=dst)


def _patch_multi_tensor_scale() -> None:
    """Patch 10: megatron's local `multi_tensor_scale` fallback without its temporary."""
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import local_multi_tensor_scale

    for mod in (clip_grads, optimizer):
        if getattr(mod, "multi_tensor_scale_impl", None) is local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = _scale_into


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None

    class _NullStream:
        def synchronize(self) -> None:
            return None

        def wait_stream(self, other: object) -> None:
            return None

    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    # Megatron calls torch.cuda.get_rng_state/set_rng_state/manual_seed; route them to the CPU
    # generator. Never call torch.manual_seed here: it calls cuda.manual_seed_all (recursion).
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def _get_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False):
        return torch.get_rng_state()

    def _set_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state


def _patch_masks() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    def sliding_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        m = torch.ones(sq, skv, dtype=torch.bool)
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
        return ~ml

    for mod in (tutils, fused_softmax):
        mod.get_default_causal_mask = causal_mask
        mod.get_sliding_window_causal_mask = sliding_mask


def _patch_moe_utils() -> None:
    from megatron.core.transformer.moe import moe_utils

    for name in (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_unpermute",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _patch_torch_norm() -> None:
    from megatron.core.transformer import torch_norm

    orig_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(orig_new, "_slime_async_patched", False):
        return

    def new(
        cls,
        config,
        hidden_size,
        eps=1e-5,
        persist_layer_norm=False,
        zero_centered_gamma=False,
        normalization="LayerNorm",
    ):
        if not config.sequence_parallel:
            return orig_new(
                cls,
                config,
                hidden_size,
                eps,
                persist_layer_norm,
                zero_centered_gamma,
                normalization,
            )
        if config.normalization != "RMSNorm":
            raise ValueError("sequence parallel on CPU supports only normalization='RMSNorm'")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    new._slime_async_patched = True
    torch_norm.WrappedTorchNorm.__new__ = new


def _patch_frozen_linear() -> None:
    from megatron.core.tensor_parallel import layers

    def backward(ctx: object, grad_output: torch.Tensor) -> tuple:
        (weight,) = ctx.saved_tensors
        g = grad_output.contiguous()
        grad_input = g.reshape(-1, g.shape[-1]).matmul(weight).view(*g.shape[:-1], weight.shape[-1])
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None

    layers.LinearWithFrozenWeight.backward = staticmethod(backward)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, adjoint: bool) -> torch.Tensor:
    """RoPE of `t` (`[..., d]`, halves `t₁`, `t₂`) with `cos`/`sin` broadcast to it, each half
    written once into a fresh tensor; `adjoint`: the backward's map of a gradient."""
    h = t.shape[-1] // 2
    t1, t2, c1, c2, s1, s2 = (
        t[..., :h],
        t[..., h:],
        cos[..., :h],
        cos[..., h:],
        sin[..., :h],
        sin[..., h:],
    )
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    o1, o2 = out[..., :h], out[..., h:]
    torch.mul(t1, c1, out=o1)
    torch.mul(t2, c2, out=o2)
    if adjoint:  # ∂t₁ = g₁·c₁ + g₂·s₂, ∂t₂ = g₂·c₂ − g₁·s₁
        o1.addcmul_(t2, s2)
        o2.addcmul_(t1, s1, value=-1)
    else:  # t₁·c₁ − t₂·s₁, t₂·c₂ + t₁·s₂
        o1.addcmul_(t2, s1, value=-1)
        o2.addcmul_(t1, s2)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        if fused.active(t):
            return fused.rotate(t, cos, sin, adjoint=False)
        return _rotate(t, cos, sin, adjoint=False)

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        if fused.active(g):
            return fused.rotate(g, cos, sin, adjoint=True), None, None
        return _rotate(g, cos, sin, adjoint=True), None, None


def _patch_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd

    def apply(
        t: torch.Tensor,
        freqs: torch.Tensor,
        rotary_interleaved: bool = False,
        multi_latent_attention: bool = False,
        mscale: float = 1.0,
    ) -> torch.Tensor:
        if rotary_interleaved or multi_latent_attention or freqs.shape[-1] != t.shape[-1]:
            return original(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos = (torch.cos(freqs) * mscale).to(t.dtype)
        sin = (torch.sin(freqs) * mscale).to(t.dtype)
        return _Rope.apply(t, cos, sin)

    apply._slime_async_patched = True
    rope_utils._apply_rotary_pos_emb_bshd = apply


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA devices to CPU and makes `Tensor.type()` report CUDA names (patch 7)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_literals_on_cpu() -> Iterator[None]:
    """Run megatron's DDP/optimizer/schedule code that hard-codes CUDA on CPU (no-op with CUDA)."""
    if cuda_available():
        yield
        return
    with _CudaToCpu():
        yield


@contextlib.contextmanager
def model_code() -> Iterator[None]:
    """Suspend `cuda_literals_on_cpu` for model code (a forward) run from inside it."""
    stack = torch.overrides._get_current_function_mode_stack()
    if cuda_available() or not stack or not isinstance(stack[-1], _CudaToCpu):
        yield
        return
    with _pop_mode_temporarily():
        yield
