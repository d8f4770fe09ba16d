"""The model an embedded engine serves: build/load, MoE top-k capture, weight swap, reference forward.

Owns: `LoadedModel` (HF causal LM in the inference dtype, tokenizer or the id codec, stop ids,
MoE shape), `RouterCapture` (forward hooks on every `*TopKRouter` module that record the chosen
expert ids per token), `swap_weights` (copy a validated state dict in; reading and checking a
checkpoint directory is `engine/disk_weights.py`) and `teacher_forced` (the reference forward
tests compare the engine against).
Must never import the server, the scheduler or aiohttp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from slime_async.contracts.chat import IdText
from slime_async.contracts.model import TINY_MOE, ModelSpec
from slime_async.contracts.vision import VL_FAMILIES, VisionSpec, image_processor
from slime_async.engine.config import EngineConfig
from slime_async.host import cpu_bf16_feature

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
BF16_VIA_FP32_MIN_TOKENS = 8
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


class IdCodec(IdText):
    """Stand-in tokenizer for models without one: text is the token ids in decimal, space-separated.

    >>> IdCodec().decode([5, 17]), IdCodec().encode("5 17")
    ('5 17', [5, 17])
    """

    unparsable = (
        "this engine has no tokenizer: `text` must be space-separated integer token ids "
        "(or send `input_ids`)"
    )


class Bf16ViaFp32(TorchFunctionMode):
    """Runs bf16 matmuls and attention as fp32 over the (exactly upcast) bf16 values and rounds
    the result to bf16: the numerics of a bf16 GEMM with fp32 accumulation (what GPU kernels
    do), 5-15x faster than torch's bf16 GEMM on CPUs without native bf16. Weights, activations
    between ops and the KV cache stay bf16."""

    OPS = frozenset(
        {
            torch.nn.functional.linear,
            torch.nn.functional.scaled_dot_product_attention,
            torch.matmul,
            torch.bmm,
            getattr(torch, "_grouped_mm", torch.matmul),
        }
    )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in self.OPS:
            return func(*args, **kwargs)

        def up(x: Any) -> Any:
            return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x

        if not any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            return func(*args, **kwargs)
        out = func(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
        return out.to(torch.bfloat16) if isinstance(out, torch.Tensor) else out


class RouterCapture:
    """Records top-k expert ids of every MoE router call while `active` (else costs nothing).

    Hooks every module whose class name ends in `TopKRouter` (HF Qwen3-MoE's router returns
    `(logits, scores, indices)` with indices `[tokens, topk]`, tokens batch-major). After a forward
    over `[B, S]` tokens, `take(B, S)` returns int32 `[B, S, num_layers, topk]`; layers without a
    router stay 0 (SGLang leaves dense-layer rows unwritten too).
    """

    def __init__(self, model: torch.nn.Module, *, num_layers: int, topk: int) -> None:
        self.num_layers, self.topk = num_layers, topk
        self.active = False
        self._calls: dict[int, torch.Tensor] = {}
        self.layers: list[int] = []
        for name, mod in model.named_modules():
            if type(mod).__name__.endswith("TopKRouter"):
                m = _LAYER_RE.search(name)
                if m is None:
                    continue
                layer = int(m.group(1))
                self.layers.append(layer)
                mod.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> Any:
        def hook(_mod: torch.nn.Module, _inp: Any, out: Any) -> None:
            if self.active:
                self._calls[layer] = out[2].detach().to(torch.int32)

        return hook

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """Expert ids of the last forward as int32 `[batch, seq, num_layers, topk]`."""
        out = torch.zeros(batch, seq, self.num_layers, self.topk, dtype=torch.int32)
        for layer, idx in self._calls.items():
            out[:, :, layer, :] = idx.view(batch, seq, self.topk)
        self._calls.clear()
        return out


@dataclasses.dataclass(kw_only=True, slots=True)
class LoadedModel:
    """An HF causal LM ready to serve, plus what the engine needs to know about it."""

    model: torch.nn.Module
    """The HF `*ForCausalLM`, eval mode, in `dtype`."""
    dtype: torch.dtype
    """Inference dtype."""
    tokenizer: Any
    """HF tokenizer, or `IdCodec` when the model has none."""
    has_tokenizer: bool
    """False when `tokenizer` is the `IdCodec` stand-in."""
    eos_token_ids: frozenset[int]
    """Ids that end a sequence unless `ignore_eos` (from the model/generation config)."""
    vocab_size: int
    """Rows of the output projection."""
    context_length: int
    """Longest prompt+output allowed."""
    num_layers: int
    """`num_hidden_layers` (the layer axis of routed experts)."""
    topk: int
    """`num_experts_per_tok` (0 for dense models)."""
    capture: RouterCapture
    """Top-k recorder (inactive unless a forward asks for it)."""
    model_path: str
    """What `/model_info` reports as `model_path`."""
    model_type: str
    """HF `model_type`."""
    bf16_via_fp32: bool = False
    """Run bf16 matmuls/attention through `Bf16ViaFp32`."""
    lora: Any = None
    """`engine.lora.EngineLora` with --enable-lora (adapters applied per row), else None."""
    borrowed: dict[int, Any] = dataclasses.field(default_factory=dict)
    """Parameters (by `id`) whose data is a read-only view of memory the engine does not own (a
    weight group's shared-memory segment), with the tag `swap_weights` was given: never written
    in place (a later swap gives them their own memory)."""
    vision: VisionSpec | None = None
    """A vision-language model's vision spec (images in `/generate`), else None."""
    image_processor: Any = None
    """The checkpoint's image processor (vision-language models only)."""

    @contextlib.contextmanager
    def compute(self, tokens: int) -> Iterator[None]:
        """Context every forward of `tokens` tokens runs in. With `bf16_via_fp32`, forwards of
        >= `BF16_VIA_FP32_MIN_TOKENS` tokens use `Bf16ViaFp32` (its per-op Python dispatch costs
        more than it saves on tiny forwards; both paths are bf16 GEMMs with fp32 accumulation
        and agree to the last bf16 bit but for rounding ties)."""
        if (
            self.bf16_via_fp32
            and self.dtype == torch.bfloat16
            and tokens >= BF16_VIA_FP32_MIN_TOKENS
        ):
            with Bf16ViaFp32():
                yield
        else:
            yield

    @property
    def is_moe(self) -> bool:
        return bool(self.capture.layers)

    def state_signature(self) -> dict[str, tuple[int, ...]]:
        """Parameter/buffer names and shapes (what a weight update must match)."""
        return {k: tuple(v.shape) for k, v in self.model.state_dict().items()}


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for src in (
        model.config,
        model.config.get_text_config(),
        getattr(model, "generation_config", None),
    ):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    if not ids and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(int(i) for i in ids)


def use_bf16_via_fp32(given: bool | None, cpu_bf16: str | None) -> bool:
    """Whether bf16 matmuls run through `Bf16ViaFp32`: as `--bf16-via-fp32` /
    `--bf16-native-matmul` say, else where the CPU has no native bf16 (`cpu_bf16`: its
    AMX/AVX512_BF16 flag, None without)."""
    return given if given is not None else cpu_bf16 is None


def load_model(cfg: EngineConfig) -> LoadedModel:
    """Build `cfg.model_spec` (random init seeded by `cfg.seed`) or load `cfg.model_dir`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    dtype = _DTYPES[cfg.dtype]
    tokenizer: Any = None
    if cfg.model_dir is None:
        spec = ModelSpec.from_dict(cfg.model_spec) if cfg.model_spec is not None else TINY_MOE
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            # init in fp32, then cast: bf16 and fp32 engines with one seed hold the same weights
            model = auto_class(spec.family).from_config(spec.to_hf_config(), dtype=torch.float32)
        model = model.to(dtype)
        model_path = "tiny-moe" if spec == TINY_MOE else f"spec-{spec.family}"
    else:
        path = Path(cfg.model_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"--model-dir {path} is not a directory")
        kw: dict[str, Any] = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
        mtype = _model_type(path)
        model = auto_class(mtype).from_pretrained(str(path), dtype=dtype, **kw)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), **kw)
        except Exception:  # no tokenizer files in the checkpoint: fall back to the id codec
            tokenizer = None
        if tokenizer is not None and len(tokenizer) < 2:
            tokenizer = None  # transformers 5 builds an empty tokenizer for a directory without one
        model_path = str(path)
    model.eval()
    hf = model.config.get_text_config()
    vision = ModelSpec.from_hf_config(model.config).vision if _is_vl(model) else None
    num_layers = int(hf.num_hidden_layers)
    topk = int(getattr(hf, "num_experts_per_tok", 0) or 0)
    ctx = int(getattr(hf, "max_position_embeddings", 2048))
    if cfg.context_length is not None:
        ctx = min(ctx, cfg.context_length)
    return LoadedModel(
        model=model,
        dtype=dtype,
        tokenizer=tokenizer if tokenizer is not None else IdCodec(),
        has_tokenizer=tokenizer is not None,
        eos_token_ids=_eos_ids(model, tokenizer),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        context_length=ctx,
        num_layers=num_layers,
        topk=topk,
        capture=RouterCapture(model, num_layers=num_layers, topk=max(topk, 1)),
        model_path=model_path,
        model_type=str(model.config.model_type),
        bf16_via_fp32=use_bf16_via_fp32(cfg.bf16_via_fp32, cpu_bf16_feature()),
        lora=_lora(model, cfg),
        vision=vision,
        image_processor=None if vision is None else image_processor(cfg.model_dir, vision),
    )


def _model_type(path: Path) -> str | None:
    import json

    f = path / "config.json"
    return json.loads(f.read_text()).get("model_type") if f.is_file() else None


def _is_vl(model: torch.nn.Module) -> bool:
    return getattr(model.config, "model_type", None) in VL_FAMILIES


def auto_class(model_type: str | None) -> Any:
    """The transformers auto class that builds a servable model of `model_type`."""
    import transformers

    if model_type in VL_FAMILIES:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def _lora(model: torch.nn.Module, cfg: EngineConfig) -> Any:
    if not cfg.enable_lora:
        return None
    from slime_async.engine.lora import EngineLora

    return EngineLora(
        model,
        ModelSpec.from_hf_config(model.config),
        targets=cfg.lora_target_modules,
        max_rank=cfg.max_lora_rank,
        max_loaded=cfg.max_loaded_loras,
    )


@torch.no_grad()
def swap_weights(lm: LoadedModel, state: dict[str, torch.Tensor], *, borrowed: Any = None) -> None:
    """Put a validated state dict (from `read_weights_from_disk` or a weight group) into the
    serving model. By default each tensor is copied in. With a `borrowed` tag (the tensors are
    read-only views that stay valid while served: a weight group's segment) every parameter of
    the same dtype and shape takes its tensor by reference instead (no copy; `lm.borrowed`
    records the tag), and the rest is copied. A parameter that was borrowed is never written
    in place: it gets memory of its own."""
    params = dict(lm.model.named_parameters(remove_duplicate=False))  # tied names too
    own = lm.model.state_dict()
    for k, v in state.items():
        p = params.get(k)
        if borrowed is not None and p is not None and _same_layout(p, v):
            p.data = v
            lm.borrowed[id(p)] = borrowed
        elif p is not None and id(p) in lm.borrowed:
            p.data = v.to(p.dtype, copy=True).contiguous()
            del lm.borrowed[id(p)]
        else:
            own[k].copy_(v)


def _same_layout(p: torch.Tensor, v: torch.Tensor) -> bool:
    return p.dtype == v.dtype and p.shape == v.shape and v.is_contiguous() and p.device == v.device


@torch.no_grad()
def teacher_forced(
    lm: LoadedModel, ids: list[int], *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference forward of one whole sequence (no cache, no padding).

    Returns `(logprobs [T-1] fp32, routed [T-1, num_layers, topk] int32)`: `logprobs[t]` is
    log p(ids[t+1] | ids[:t+1]) of the temperature-scaled distribution, `routed[t]` the experts
    chosen for token t (the last token is never forwarded by the engine, so it is dropped here).
    """
    x = torch.tensor([ids], dtype=torch.long)
    lm.capture.active = True
    try:
        with lm.compute(len(ids)):
            logits = lm.model(input_ids=x, use_cache=False).logits[0].float()
        routed = lm.capture.take(1, len(ids))[0]
    finally:
        lm.capture.active = False
    t = 1.0 if temperature < 1e-6 else temperature
    lp = torch.log_softmax(logits[:-1] / t, dim=-1)
    return lp.gather(1, x[0, 1:, None])[:, 0], routed[:-1]
