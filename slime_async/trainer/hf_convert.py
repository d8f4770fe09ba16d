"""Megatron ⇄ Hugging Face tensor mapping for every `ModelSpec` family (gathers/slices TP, EP).

Owns: the name and layout mapping between a megatron-core GPTModel (local spec, any TP/EP) and
the HF checkpoint format that `transformers` 5.23 writes with `save_pretrained`
(`Qwen3MoeForCausalLM`: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`;
`Qwen3ForCausalLM` and `Qwen3MoeForCausalLM`: `self_attn.{q,k}_norm.weight`;
`Qwen2ForCausalLM`: `self_attn.{q,k,v}_proj.bias`; `LlamaForCausalLM`, `MistralForCausalLM`;
`Qwen2_5_VLForConditionalGeneration`: Qwen2's names plus the vision tower's `visual.*`, which
are the trainer's `vision.*` one for one; `Qwen3VLForConditionalGeneration`: Qwen3's names under
`model.language_model.` and the tower's under `model.visual.`). The names and shapes of a spec's
checkpoint are `hf_shapes.py`'s.
This is our own converter rather than mbridge (see docs/real-workloads.md). Must never import the controller, engine, rollout or data-worker parts of
`slime_async`.

Layout facts used below (megatron-core 0.16):
* `linear_qkv.weight` is grouped per KV head: `[nkv, nq/nkv + 2, head_dim, H]` (q heads of the
  group, then k, then v); TP splits the KV-group axis. `linear_qkv.bias` (Qwen2) is grouped
  the same way: `[nkv, nq/nkv + 2, head_dim]`.
* Gated `linear_fc1.weight` is `[gate; up]` *per TP shard*: each rank holds `[gate_r; up_r]`.
* `linear_proj`/`linear_fc2` are row-parallel (split on the input axis, dim 1).
* Routed expert `e` lives on EP rank `e // (E/ep)` as local expert `e % (E/ep)`.
* Parameter names carry *global* layer indices (`model.global_named_parameters`), so pipeline
  stages and virtual-pipeline chunks need no offset here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

from slime_async.contracts.model import ModelSpec
from slime_async.trainer.hf_shapes import hf_names, hf_shapes
from slime_async.trainer.model import global_named_parameters
from slime_async.trainer.parallel import all_gather_cat, all_reduce_sum
from slime_async.trainer.towers import hf_prefixes

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

_VISION = "vision."
"""The vision tower's parameters (`vision.py`) carry the HF names after `hf_prefixes`'s."""
__all__ = ["hf_names", "hf_shapes", "hf_to_megatron", "megatron_to_hf", "megatron_to_hf_tensors"]

_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


class _Ranks:
    """This rank's TP/EP coordinates and groups (trivial when not distributed)."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        on = dist.is_initialized() and ps.model_parallel_is_initialized()
        self.tp = ps.get_tensor_model_parallel_world_size() if on else 1
        self.tp_rank = ps.get_tensor_model_parallel_rank() if on else 0
        self.tp_group = ps.get_tensor_model_parallel_group() if on else None
        self.etp = ps.get_expert_tensor_parallel_world_size() if on else 1
        self.etp_rank = ps.get_expert_tensor_parallel_rank() if on else 0
        self.etp_group = ps.get_expert_tensor_parallel_group() if on else None
        self.ep = ps.get_expert_model_parallel_world_size() if on else 1
        self.ep_rank = ps.get_expert_model_parallel_rank() if on else 0
        self.ep_group = ps.get_expert_model_parallel_group() if on else None
        self.pp = ps.get_pipeline_model_parallel_world_size() if on else 1
        self.pp_rank = ps.get_pipeline_model_parallel_rank() if on else 0
        self.pp_group = ps.get_pipeline_model_parallel_group() if on else None


def _gather(t: torch.Tensor, group: dist.ProcessGroup | None, n: int) -> list[torch.Tensor]:
    if n == 1:
        return [t]
    return list(all_gather_cat(t.detach(), group).chunk(n, 0))


def _cat(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """`torch.cat`, except that one tensor is returned as it is (cat would copy it)."""
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim=dim)


def _split_gated(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = t.shape[0] // 2
    return t[:half], t[half:]


# --------------------------------------------------------------------------- export
def _chunks(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


@torch.no_grad()
def megatron_to_hf(
    model: torch.nn.Module | list[torch.nn.Module], spec: ModelSpec, *, copy: bool = True
) -> dict[str, torch.Tensor]:
    """Full HF-named fp32 CPU tensors from this rank's shards (collective over TP, EP and PP).

    `model` is one GPTModel or this rank's chunks. Every rank must call it; every rank gets
    the full dict. `copy=False` (a weight push, read at once): without pipeline parallelism the
    tensors stay in the parameters' dtype and device and are views of them wherever the layout
    allows (everything but q/k/v, which megatron interleaves): no model-sized copy is made, and
    they must be read before the parameters change.
    """
    return megatron_to_hf_tensors(global_named_parameters(_chunks(model)), spec, copy=copy)


@torch.no_grad()
def megatron_to_hf_tensors(
    params: dict[str, torch.Tensor], spec: ModelSpec, *, copy: bool = True
) -> dict[str, torch.Tensor]:
    """Same as `megatron_to_hf` for any per-parameter tensors (weights, Adam moments, ...)."""
    r = _Ranks()
    out: dict[str, torch.Tensor] = {}
    nkv, nq, hd = spec.num_key_value_heads, spec.num_attention_heads, spec.head_dim
    grp = nq // nkv

    def gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
        return _cat(_gather(t, r.tp_group, r.tp), dim)

    lm, vis = hf_prefixes(spec.family)
    if "embedding.word_embeddings.weight" in params:  # first pipeline stage
        out[lm + "embed_tokens.weight"] = gather_tp(params["embedding.word_embeddings.weight"], 0)
    if "output_layer.weight" in params and not spec.tie_word_embeddings:  # last stage
        out["lm_head.weight"] = gather_tp(params["output_layer.weight"], 0)
    if "decoder.final_layernorm.weight" in params:
        out[lm + "norm.weight"] = params["decoder.final_layernorm.weight"]
    experts: dict[tuple[int, int, str], torch.Tensor] = {}
    for name, p in params.items():
        if name.startswith(_VISION):  # the vision tower is whole on every rank that has it
            out[vis + name[len(_VISION) :]] = p
            continue
        m = _LAYER.match(name)
        if m is None:
            continue
        i, rest = int(m.group(1)), m.group(2)
        pre = f"{lm}layers.{i}."
        if rest in _SIMPLE:
            out[pre + _SIMPLE[rest]] = p
        elif rest == "self_attention.linear_qkv.weight":
            full = gather_tp(p, 0).view(nkv, grp + 2, hd, -1)
            hidden = full.shape[-1]
            out[pre + "self_attn.q_proj.weight"] = full[:, :grp].reshape(nq * hd, hidden)
            out[pre + "self_attn.k_proj.weight"] = full[:, grp].reshape(nkv * hd, hidden)
            out[pre + "self_attn.v_proj.weight"] = full[:, grp + 1].reshape(nkv * hd, hidden)
        elif rest == "self_attention.linear_qkv.bias":
            full = gather_tp(p, 0).view(nkv, grp + 2, hd)
            out[pre + "self_attn.q_proj.bias"] = full[:, :grp].reshape(nq * hd)
            out[pre + "self_attn.k_proj.bias"] = full[:, grp].reshape(nkv * hd)
            out[pre + "self_attn.v_proj.bias"] = full[:, grp + 1].reshape(nkv * hd)
        elif rest == "self_attention.linear_proj.weight":
            out[pre + "self_attn.o_proj.weight"] = gather_tp(p, 1)
        elif rest == "mlp.linear_fc1.weight":
            shards = [_split_gated(s) for s in _gather(p, r.tp_group, r.tp)]
            out[pre + "mlp.gate_proj.weight"] = _cat([g for g, _ in shards], 0)
            out[pre + "mlp.up_proj.weight"] = _cat([u for _, u in shards], 0)
        elif rest == "mlp.linear_fc2.weight":
            out[pre + "mlp.down_proj.weight"] = gather_tp(p, 1)
        elif (em := _EXPERT.match(rest)) is not None:
            experts[(i, int(em.group(1)), em.group(2))] = p
        else:
            raise KeyError(f"no HF mapping for megatron parameter {name!r}")
    _export_experts(experts, spec, r, out)
    if not copy and r.pp == 1:  # read at once by the caller (a weight push)
        return {k: v.detach() for k, v in out.items()}
    # copies: the export must not alias live parameters (the optimizer mutates them)
    full = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in out.items()}
    return _union_pipeline(full, spec, r)


def _union_pipeline(
    local: dict[str, torch.Tensor], spec: ModelSpec, r: _Ranks
) -> dict[str, torch.Tensor]:
    """Every pipeline stage gets every stage's tensors (zero-filled sum over the PP group)."""
    if r.pp == 1:
        return local
    shapes = hf_shapes(spec)
    names = sorted(shapes)
    flat = torch.cat([local.get(n, torch.zeros(shapes[n])).reshape(-1) for n in names])
    all_reduce_sum(flat, r.pp_group)
    out, at = {}, 0
    for n in names:
        size = int(torch.Size(shapes[n]).numel())
        out[n] = flat[at : at + size].view(shapes[n]).clone()
        at += size
    return out


def _export_experts(
    experts: dict[tuple[int, int, str], torch.Tensor],
    spec: ModelSpec,
    r: _Ranks,
    out: dict[str, torch.Tensor],
) -> None:
    if not experts:
        return
    per_rank = spec.num_experts // r.ep
    for (i, le, kind), p in sorted(experts.items()):
        etp_shards = _gather(p, r.etp_group, r.etp)
        if kind == "linear_fc1" and len(etp_shards) > 1:
            halves = [_split_gated(s) for s in etp_shards]
            local = torch.cat(
                [torch.cat([g for g, _ in halves], 0), torch.cat([u for _, u in halves], 0)], 0
            )
        else:  # one shard is already [gate; up]
            local = _cat(etp_shards, 1)
        for ep_rank, t in enumerate(_gather(local, r.ep_group, r.ep)):
            e = ep_rank * per_rank + le
            pre = f"model.layers.{i}.mlp.experts.{e}."
            if kind == "linear_fc1":
                gate, up = _split_gated(t)
                out[pre + "gate_proj.weight"] = gate
                out[pre + "up_proj.weight"] = up
            else:
                out[pre + "down_proj.weight"] = t


# --------------------------------------------------------------------------- import
def _normalize_hf(hf: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Accept both per-expert names (what save_pretrained writes) and fused runtime names."""
    out = dict(hf)
    for name in list(hf):
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m is None:
            continue
        t = out.pop(name)
        for e in range(t.shape[0]):
            pre = f"{m.group(1)}.{e}."
            if m.group(2) == "gate_up_proj":
                gate, up = _split_gated(t[e])
                out[pre + "gate_proj.weight"], out[pre + "up_proj.weight"] = gate, up
            else:
                out[pre + "down_proj.weight"] = t[e]
    if spec.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _shard(t: torch.Tensor, rank: int, n: int, dim: int) -> torch.Tensor:
    if t.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} is not divisible by {n} ranks")
    return t.chunk(n, dim=dim)[rank]


@torch.no_grad()
def hf_to_megatron(
    model: torch.nn.Module | list[torch.nn.Module], spec: ModelSpec, hf: dict[str, torch.Tensor]
) -> None:
    """Copy full HF-named tensors into this rank's megatron shards (no communication).

    Raises KeyError naming missing/unused tensors, ValueError on a shape mismatch.

    One parameter at a time, in the tensors' own dtype until the copy casts it: the import
    holds no model-sized temporary (an fp32 copy of a bf16 export was one).
    """
    params = global_named_parameters(_chunks(model))
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    for name, t in _iter_shards(hf, spec, shapes, upcast=False):
        params[name].copy_(t)  # casts to the parameter's dtype and device


@torch.no_grad()
def hf_to_megatron_tensors(
    hf: dict[str, torch.Tensor], spec: ModelSpec, shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """This rank's shards (global megatron name → fp32 tensor) of full HF-named tensors."""
    return {n: t.contiguous() for n, t in _iter_shards(hf, spec, shapes, upcast=True)}


def _iter_shards(
    hf: dict[str, torch.Tensor],
    spec: ModelSpec,
    shapes: dict[str, tuple[int, ...]],
    *,
    upcast: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, this rank's shard) of each of `shapes`, made one at a time (fp32 when
    `upcast`, else the HF tensors' dtype; a model import, which also needs every tensor). The
    HF tensors' names and shapes are checked before the first shard is made, so the import of
    a checkpoint of another model changes nothing."""
    hf = _normalize_hf(hf, spec)
    unused = sorted(set(hf) - hf_names(spec))
    if unused:
        raise KeyError(
            f"HF checkpoint has tensors a {spec.family} model does not use: {unused[:5]}; "
            "is it a checkpoint of another model family?"
        )
    want = hf_shapes(spec)
    missing = sorted(set(want) - set(hf)) if not upcast else []  # the import: every tensor
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KeyError(f"HF checkpoint is missing tensor {missing[0]!r}{more}")
    for k, t in hf.items():
        if k in want and tuple(t.shape) != tuple(want[k]):
            raise ValueError(
                f"HF tensor {k!r} has shape {tuple(t.shape)}, a model of this spec has "
                f"{tuple(want[k])}: the checkpoint does not match this ModelSpec"
            )
    src = _HfShards(hf, spec, _Ranks(), upcast=upcast)
    for name, shape in shapes.items():
        new = src.shard(name)
        if tuple(new.shape) != tuple(shape):
            raise ValueError(
                f"HF tensor for {name!r} has shape {tuple(new.shape)}, model expects "
                f"{tuple(shape)}: the checkpoint does not match this ModelSpec"
            )
        yield name, new


class _HfShards:
    """This rank's shard of each megatron parameter, cut from full HF-named tensors."""

    def __init__(
        self, hf: dict[str, torch.Tensor], spec: ModelSpec, ranks: _Ranks, *, upcast: bool = True
    ) -> None:
        self.hf, self.spec, self.r, self.upcast = hf, spec, ranks, upcast
        self.per_rank = spec.num_experts // ranks.ep if spec.is_moe else 0

    def get(self, key: str) -> torch.Tensor:
        if key not in self.hf:
            raise KeyError(f"HF checkpoint is missing tensor {key!r}")
        return self.hf[key].float() if self.upcast else self.hf[key]

    def shard(self, name: str) -> torch.Tensor:
        """The shard of megatron parameter `name` (KeyError when no HF tensor maps to it)."""
        r = self.r
        lm, vis = hf_prefixes(self.spec.family)
        if name == "embedding.word_embeddings.weight":
            return _shard(self.get(lm + "embed_tokens.weight"), r.tp_rank, r.tp, 0)
        if name == "output_layer.weight":
            return _shard(self.get("lm_head.weight"), r.tp_rank, r.tp, 0)
        if name == "decoder.final_layernorm.weight":
            return self.get(lm + "norm.weight")
        if name.startswith(_VISION):
            return self.get(vis + name[len(_VISION) :])
        m = _LAYER.match(name)
        if m is None:
            raise KeyError(f"no HF mapping for megatron parameter {name!r}")
        new = self._layer(f"{lm}layers.{int(m.group(1))}.", m.group(2))
        if new is None:
            raise KeyError(f"no HF mapping for megatron parameter {name!r}")
        return new

    def _layer(self, pre: str, rest: str) -> torch.Tensor | None:
        """Parameter `rest` of the layer whose HF names start with `pre` (None: unmapped)."""
        r, get = self.r, self.get
        if rest in _SIMPLE:
            return get(pre + _SIMPLE[rest])
        if rest == "self_attention.linear_qkv.weight":
            full = self._qkv(pre, "weight")
            return _shard(full, r.tp_rank, r.tp, 0).reshape(-1, full.shape[-1])
        if rest == "self_attention.linear_qkv.bias":
            return _shard(self._qkv(pre, "bias"), r.tp_rank, r.tp, 0).reshape(-1)
        if rest == "self_attention.linear_proj.weight":
            return _shard(get(pre + "self_attn.o_proj.weight"), r.tp_rank, r.tp, 1)
        if rest == "mlp.linear_fc1.weight":
            return self._gated(pre + "mlp.", r.tp_rank, r.tp)
        if rest == "mlp.linear_fc2.weight":
            return _shard(get(pre + "mlp.down_proj.weight"), r.tp_rank, r.tp, 1)
        if (em := _EXPERT.match(rest)) is not None:
            e = r.ep_rank * self.per_rank + int(em.group(1))
            epre = f"{pre}mlp.experts.{e}."
            if em.group(2) == "linear_fc1":
                return self._gated(epre, r.etp_rank, r.etp)
            return _shard(get(epre + "down_proj.weight"), r.etp_rank, r.etp, 1)
        return None

    def _qkv(self, pre: str, kind: str) -> torch.Tensor:
        """q, k and v of one layer interleaved per KV group, megatron's fused layout:
        `[nkv, q-per-group + 2, head_dim(, hidden)]`."""
        spec = self.spec
        nkv, hd = spec.num_key_value_heads, spec.head_dim
        grp = spec.num_attention_heads // nkv
        tail = (-1,) if kind == "weight" else ()
        q = self.get(f"{pre}self_attn.q_proj.{kind}").view(nkv, grp, hd, *tail)
        k = self.get(f"{pre}self_attn.k_proj.{kind}").view(nkv, 1, hd, *tail)
        v = self.get(f"{pre}self_attn.v_proj.{kind}").view(nkv, 1, hd, *tail)
        return torch.cat([q, k, v], 1)

    def _gated(self, pre: str, rank: int, n: int) -> torch.Tensor:
        """The fused gate/up projection: each one's shard, gate first."""
        gate, up = self.get(pre + "gate_proj.weight"), self.get(pre + "up_proj.weight")
        return torch.cat([_shard(gate, rank, n, 0), _shard(up, rank, n, 0)], 0)
