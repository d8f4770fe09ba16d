"""LoRA adapters on a megatron-core GPTModel, in PEFT's names and layout.

Owns: attaching adapters to this rank's chunks (`attach`: a `lora` child module and a forward
hook on each targeted linear layer, the base frozen), the adapter tensors in PEFT's keys
(`adapter_tensors`: gathered over TP and PP; `load_adapter_tensors`: sliced back) and the
merged HF weights `W + (alpha / r) · B A` (`merge`). The run's `LoraSpec`, the PEFT
directory format and its checks are the contract `slime_async.contracts.adapter`'s
(`lora_spec`). Must never import the controller, engine, rollout or
data-worker parts of `slime_async`.

Layout (megatron-core 0.16, `hf_convert` has the base weights' facts): `linear_qkv` and
`linear_fc1` are column-parallel and fused, so one megatron layer carries the adapters of
several PEFT modules (q/k/v, gate/up); `linear_proj` (o_proj) and `linear_fc2` (down_proj)
are row-parallel.

* column-parallel: A `[r, d_in]` is replicated over TP, B `[d_out / tp, r]` holds this rank's
  output rows (a contiguous block of PEFT's rows: KV groups for q/k/v, the MLP shard for
  gate/up). With sequence parallelism the rank-r activation `x A^T` is computed on this rank's
  tokens and all-gathered over the sequence (its backward reduce-scatters), and A's gradient
  is summed over TP like a sequence-parallel norm (`sequence_parallel` attribute).
* row-parallel: A `[r, d_in / tp]` holds this rank's input columns, B `[d_out, r]` is
  replicated; `x A^T` is a partial sum, reduce-scattered over the sequence (all-reduced
  without sequence parallelism), and B's gradient is summed over TP.

Worked example (TP=2, hidden 128, 4 q heads and 2 KV heads of 32, r=8): rank 1's
`linear_qkv.lora` holds `A.q_proj [8, 128]` (the full A), `B.q_proj [64, 8]` (PEFT rows
64..127: KV group 1's two q heads), `B.k_proj [32, 8]` and `B.v_proj [32, 8]` (rows 32..63);
its delta is laid out per KV group `[q, q, k, v] × 32` like megatron's fused weight.

The adapters are fp32 whatever the base's dtype; their output is cast to the layer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from slime_async.contracts.adapter import (
    PEFT_MODULES,
    LoraSpec,
    module_dims,
    peft_name,
    peft_shapes,
)
from slime_async.contracts.model import ModelSpec

ADAPTER_MARK = ".lora."
"""Substring of every adapter parameter's megatron name (`....linear_qkv.lora.A.q_proj`)."""

# megatron layer -> (its PEFT modules, column- or row-parallel)
_LAYERS = {
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": (("o_proj",), "row"),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": (("down_proj",), "row"),
}


# --------------------------------------------------------------------------- the module
class LoraAdapter(torch.nn.Module):
    """The adapters of one megatron linear layer (`A.<module>`, `B.<module>`: this rank's
    shards), and the delta its forward hook adds to the layer's output."""

    def __init__(
        self,
        modules: tuple[str, ...],
        kind: str,
        shapes: dict[str, tuple[int, int]],
        *,
        lora: LoraSpec,
        model: Any,
        tp: int,
        tp_rank: int,
        sequence_parallel: bool,
        init: dict[str, torch.Tensor],
    ) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.modules_, self.kind, self.lora = modules, kind, lora
        self.sequence_parallel = sequence_parallel and tp > 1
        self.tp = tp
        self.groups = model.num_key_value_heads // tp  # KV groups of this rank (qkv layout)
        self.q_per_group = model.num_attention_heads // model.num_key_value_heads
        self.head_dim = model.head_dim
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        for m in modules:
            (r, _), (d_out, _) = shapes[f"{m}.A"], shapes[f"{m}.B"]
            a_full = init[m]
            if kind == "column":  # A replicated, B's output rows sharded
                a = torch.nn.Parameter(a_full.clone())
                b = torch.nn.Parameter(torch.zeros(d_out // tp, r))
                set_tensor_model_parallel_attributes(b, True, 0, 1)
                if self.sequence_parallel:
                    a.sequence_parallel = True
            else:  # A's input columns sharded, B replicated
                a = torch.nn.Parameter(a_full.chunk(tp, 1)[tp_rank].clone())
                b = torch.nn.Parameter(torch.zeros(d_out, r))
                set_tensor_model_parallel_attributes(a, True, 1, 1)
                if self.sequence_parallel:
                    b.sequence_parallel = True
            self.A[m], self.B[m] = a, b
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """`(alpha / r) · B A x` of every module, laid out as the layer's (local) output."""
        from megatron.core import tensor_parallel as tpar

        x = x.float()
        low = [self.dropout(x) @ self.A[m].t() for m in self.modules_]
        if self.kind == "column":
            h = torch.cat(low, -1)
            if self.sequence_parallel:
                h = tpar.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
            elif self.tp > 1:
                h = tpar.copy_to_tensor_model_parallel_region(h)
            parts = [
                hm @ self.B[m].t() for m, hm in zip(self.modules_, h.split(self.lora.rank, -1))
            ]
            out = self._fuse(parts, h.shape[:-1])
        else:
            h = low[0]
            if self.sequence_parallel:
                h = tpar.reduce_scatter_to_sequence_parallel_region(h)
            elif self.tp > 1:
                h = tpar.reduce_from_tensor_model_parallel_region(h)
            out = h @ self.B[self.modules_[0]].t()
        return out * self.lora.scaling

    def _fuse(self, parts: list[torch.Tensor], lead: torch.Size) -> torch.Tensor:
        if len(parts) == 2:  # [gate_r; up_r]
            return torch.cat(parts, -1)
        q, k, v = (p.reshape(*lead, self.groups, -1) for p in parts)
        return torch.cat([q, k, v], -1).reshape(*lead, -1)


def _hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + module.lora.delta(x).to(out.dtype), bias


def _full_shapes(model: ModelSpec, lora: LoraSpec) -> dict[str, tuple[int, int]]:
    """{'<module>.A' | '<module>.B': full shape} of one layer's adapters (every module)."""
    out = {}
    for m, (d_in, d_out) in module_dims(model).items():
        out[f"{m}.A"], out[f"{m}.B"] = (lora.rank, d_in), (d_out, lora.rank)
    return out


def init_a(layer: int, module: str, shape: tuple[int, int], *, seed: int) -> torch.Tensor:
    """PEFT's default A init (kaiming-uniform with a = √5: U(−1/√d_in, 1/√d_in)), drawn from a
    generator seeded by (seed, layer, module), so every TP rank and layout draws the same A."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + PEFT_MODULES.index(module))
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul(bound).float()


def attach(chunks: list[torch.nn.Module], model: Any, lora: LoraSpec, *, seed: int) -> None:
    """Freeze every base parameter of `chunks` and add the targeted adapters (A: PEFT's init,
    B: zeros, so the adapted model starts equal to the base)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
            i = layer.layer_number - 1
            shapes = _full_shapes(model, lora)
            for path, (modules, kind) in _LAYERS.items():
                chosen = tuple(m for m in modules if m in lora.targets)
                if not chosen:
                    continue
                linear = layer.get_submodule(path)
                init = {m: init_a(i, m, shapes[f"{m}.A"], seed=seed) for m in modules}
                linear.lora = LoraAdapter(
                    modules if kind == "column" else chosen,
                    kind,
                    shapes,
                    lora=lora,
                    model=model,
                    tp=tp,
                    tp_rank=tp_rank,
                    sequence_parallel=chunk.config.sequence_parallel,
                    init=init,
                ).to(linear.weight.device)
                if kind == "column":  # untargeted parts of a fused layer: no adapter, no grad
                    for m in modules:
                        if m not in chosen:
                            linear.lora.A[m].requires_grad_(False)
                            linear.lora.B[m].requires_grad_(False)
                linear.register_forward_hook(_hook, with_kwargs=True)


def keep_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Cast the adapters of `module` back to fp32 after megatron's `Float16Module` made every
    parameter bf16 (--bf16): the base computes in bf16, the adapters train and compute in fp32."""
    for name, p in module.named_parameters():
        if ADAPTER_MARK in name:
            p.data = p.data.float()
    return module


# --------------------------------------------------------------------------- PEFT tensors
def _adapters(chunks: list[torch.nn.Module]) -> list[tuple[int, LoraAdapter]]:
    """(global layer index, adapter) of this rank's chunks, in layer then `_LAYERS` order."""
    out = []
    for chunk in chunks:
        for layer in getattr(getattr(chunk, "decoder", None), "layers", []):
            for path in _LAYERS:
                try:
                    linear = layer.get_submodule(path)
                except AttributeError:  # an MoE layer: routed experts, no dense projection
                    continue
                ad = getattr(linear, "lora", None)
                if ad is not None:
                    out.append((layer.layer_number - 1, ad))
    return out


def is_adapter_param(name: str) -> bool:
    """Whether a megatron parameter name is an adapter's (not a base weight)."""
    return ADAPTER_MARK in name


def adapter_named_parameters(
    chunks: list[torch.nn.Module], lora: LoraSpec
) -> dict[str, torch.nn.Parameter]:
    """{PEFT key: this rank's shard} of every trained adapter matrix (the optimizer's view)."""
    out = {}
    for i, ad in _adapters(chunks):
        for m in ad.modules_:
            if m in lora.targets:
                out[peft_name(i, m, "A")] = ad.A[m]
                out[peft_name(i, m, "B")] = ad.B[m]
    return out


def _split_dim(key: str, kind: str) -> int | None:
    """The TP-sharded dimension of one adapter matrix (None: replicated)."""
    if kind == "column":
        return 0 if ".lora_B." in key else None
    return 1 if ".lora_A." in key else None


def _kinds(chunks: list[torch.nn.Module]) -> dict[str, str]:
    return {
        peft_name(i, m, w): ad.kind
        for i, ad in _adapters(chunks)
        for m in ad.modules_
        for w in ("A", "B")
    }


@torch.no_grad()
def gather_peft(
    chunks: list[torch.nn.Module],
    model: ModelSpec,
    lora: LoraSpec,
    local: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Full fp32 CPU tensors from this rank's per-adapter-matrix shards `local` (PEFT keys: the
    matrices themselves, or their Adam moments); collective over TP and PP, every rank gets all."""
    from megatron.core import parallel_state as ps

    from slime_async.trainer.parallel import all_gather_cat, all_reduce_sum

    tp_group = ps.get_tensor_model_parallel_group()
    kinds = _kinds(chunks)
    out: dict[str, torch.Tensor] = {}
    for key in sorted(local):  # the same order on every TP rank
        t = local[key].detach().float()
        dim = _split_dim(key, kinds[key])
        if dim is not None:
            t = all_gather_cat(t, tp_group, dim=dim)
        out[key] = t.to("cpu", copy=True)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return out
    shapes = peft_shapes(model, lora)  # every stage gets every stage's: zero-filled sum
    names = sorted(shapes)
    flat = torch.cat([out.get(n, torch.zeros(shapes[n])).reshape(-1) for n in names])
    all_reduce_sum(flat, ps.get_pipeline_model_parallel_group())
    full, at = {}, 0
    for n in names:
        size = math.prod(shapes[n])
        full[n] = flat[at : at + size].view(shapes[n]).clone()
        at += size
    return full


def shard_peft(
    chunks: list[torch.nn.Module], tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """This rank's shards (PEFT keys of its layers) of full PEFT-keyed tensors."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    out = {}
    for key, kind in _kinds(chunks).items():
        if key not in tensors:
            continue
        dim = _split_dim(key, kind)
        t = tensors[key]
        out[key] = t if dim is None else t.chunk(tp, dim)[tp_rank]
    return out


def adapter_tensors(
    chunks: list[torch.nn.Module], model: ModelSpec, lora: LoraSpec
) -> dict[str, torch.Tensor]:
    """Full fp32 CPU adapter matrices in PEFT's keys (collective over TP and PP: every rank gets
    all of them)."""
    return gather_peft(chunks, model, lora, adapter_named_parameters(chunks, lora))


@torch.no_grad()
def load_adapter_tensors(chunks: list[torch.nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    """Copy full PEFT-keyed adapter matrices into this rank's shards (no communication)."""
    params = {
        peft_name(i, m, w): getattr(ad, w)[m]
        for i, ad in _adapters(chunks)
        for m in ad.modules_
        for w in ("A", "B")
    }
    for key, t in shard_peft(chunks, tensors).items():
        params[key].copy_(t.to(params[key].device, params[key].dtype))


def merge(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], lora: LoraSpec
) -> dict[str, torch.Tensor]:
    """HF weights with every adapter folded in: `W + (alpha / r) · B A` (fp32), others as is."""
    fold = merger(adapters, lora)
    return {k: fold(k, w).to(w.dtype) for k, w in base.items()}


def merger(
    adapters: dict[str, torch.Tensor], lora: LoraSpec
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """`merge` one HF tensor at a time: `(name, W) -> W + (alpha / r) · B A` in fp32 for a
    weight with an adapter, `W` itself otherwise. An export written tensor by tensor folds the
    adapter in as it writes (`weights_io.write_hf_dir`'s `transform`), never holding a merged
    copy of the whole model."""
    pairs = {}
    for key_a, a in adapters.items():
        if key_a.endswith(".lora_A.weight"):
            name = key_a.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            pairs[name] = (a, adapters[key_a.replace(".lora_A.", ".lora_B.")])

    def fold(name: str, w: torch.Tensor) -> torch.Tensor:
        if name not in pairs:
            return w
        a, b = pairs[name]
        return w.float() + lora.scaling * (b.double() @ a.double()).float()

    return fold


def adapter_params(chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The trainable adapter parameters of this rank's chunks."""
    return [
        p
        for c in chunks
        for n, p in c.named_parameters()
        if is_adapter_param(n) and p.requires_grad
    ]


# --------------------------------------------------------------------------- checkpoints
def optimizer_moments(optim: Any, chunks: list[torch.nn.Module], model: ModelSpec, lora: LoraSpec):
    """{moment: {PEFT key: full tensor}} of the adapters' optimizer state (collective over DP,
    TP, PP): what a checkpoint stores instead of the base's (which has none)."""
    local = optim.state_tensors(adapter_named_parameters(chunks, lora))
    return {k: gather_peft(chunks, model, lora, v) for k, v in local.items()}


def load_optimizer_moments(
    optim: Any,
    chunks: list[torch.nn.Module],
    lora: LoraSpec,
    moments: dict[str, dict[str, torch.Tensor]],
    *,
    step: int,
) -> None:
    """Install `optimizer_moments`' output into this rank's optimizer (its shards)."""
    shards = {k: shard_peft(chunks, v) for k, v in moments.items()}
    optim.load_state_tensors(shards, adapter_named_parameters(chunks, lora), step=step)


def check_checkpoint(saved: dict[str, Any] | None, lora: LoraSpec | None, *, where: str) -> None:
    """Refuse a resume whose adapter shape differs from this run's (ValueError with the fix)."""
    mine = None if lora is None else lora.peft_config()
    keys = ("r", "lora_alpha", "target_modules")
    if (saved is None) != (mine is None) or (
        saved is not None and any(saved.get(k) != mine.get(k) for k in keys)
    ):
        have = "no adapter" if saved is None else {k: saved.get(k) for k in keys}
        want = "no adapter" if mine is None else {k: mine[k] for k in keys}
        raise ValueError(
            f"{where} was saved with {have} but this run trains {want}; resume with the "
            "checkpoint's --lora-rank/--lora-alpha/--lora-target-modules (0 rank: full "
            "fine-tuning), or start from its HF export with --hf-checkpoint"
        )
