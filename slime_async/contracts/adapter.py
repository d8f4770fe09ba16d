"""LoRA adapter contract: the shape a run's adapters have, and the PEFT directory that carries one.

Owns `LoraSpec` (rank, alpha, dropout, target projections) and `lora_spec` (the run's spec,
built from the trainer config and checked against the model: the one place both happen), the
PEFT/SGLang module names (`PEFT_MODULES`, `parse_targets`), the MoE rule (`NO_EXPERT_ADAPTERS`,
`expert_targets`: routed experts take no adapter), PEFT's state-dict keys and shapes of a model's adapters
(`peft_name`, `peft_shapes`), the PEFT directory (`adapter_config.json` +
`adapter_model.safetensors`, written atomically with a sha256 beside it: `write_peft_dir`;
read without unpickling anything: `read_peft_dir`) and the check every receiver runs before an
adapter serves (`check_adapter`: names, shapes, rank, finite values). The trainer writes what
the engines read; both import it from here. Imports torch only inside the functions that move
tensors, so the config wing and torch-free config modules may import the names and the spec.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_async.contracts.model import ModelSpec

if TYPE_CHECKING:
    import torch

PEFT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, as PEFT and SGLang name them."""
ATTENTION_MODULES = PEFT_MODULES[:4]
"""The attention projections: on an MoE model the only ones an adapter may target."""
NO_EXPERT_ADAPTERS = "this model's MLPs are routed experts, which take no adapter"
"""The MoE rule (`expert_targets`), as every refusal of it says."""
ADAPTER_NAME = "policy"
"""The name a LoRA run's engines serve its adapter under (every request's `lora_path`)."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CHECKSUM_FILE = "adapter_model.sha256"
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


def parse_targets(text: str) -> tuple[str, ...]:
    """`q_proj,v_proj` → ('q_proj', 'v_proj') in PEFT_MODULES order; 'all' → every module.
    An unknown name is refused with the accepted ones (ValueError)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return PEFT_MODULES
    bad = [n for n in names if n not in PEFT_MODULES]
    if bad or not names:
        raise ValueError(
            f"LoRA target modules {text!r}: {', '.join(bad) or 'no module'} is not a projection "
            f"an adapter can target; use a comma-separated subset of {','.join(PEFT_MODULES)} "
            "or 'all'"
        )
    return tuple(n for n in PEFT_MODULES if n in names)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    """One run's adapter shape: what a trained adapter and every engine agree on."""

    rank: int
    """r: A is `[r, d_in]`, B is `[d_out, r]`."""
    alpha: float
    """The update is `(alpha / r) · B A` (PEFT's lora_alpha, no rsLoRA)."""
    dropout: float = 0.0
    """Dropout on the adapter's input in training forwards."""
    targets: tuple[str, ...] = PEFT_MODULES
    """PEFT module names that carry an adapter."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, *, base_model: str | None = None) -> dict[str, Any]:
        """`adapter_config.json` as PEFT writes it for a causal LM."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": list(self.targets),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "base_model_name_or_path": base_model,
            "inference_mode": True,
        }

    @classmethod
    def from_peft_config(cls, d: dict[str, Any]) -> LoraSpec:
        """The spec of a PEFT `adapter_config.json`; refuses what the engines cannot apply."""
        if d.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"peft_type {d.get('peft_type')!r}: only LORA adapters are served")
        for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
            if d.get(key):
                raise ValueError(f"adapter_config.json sets {key}; only plain LoRA is served")
        if d.get("bias", "none") != "none":
            raise ValueError("adapter_config.json: bias must be 'none'")
        targets = d.get("target_modules")
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not targets:
            raise ValueError("adapter_config.json: target_modules must be a non-empty list")
        rank, alpha = d.get("r"), d.get("lora_alpha")
        if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
            raise ValueError("adapter_config.json: r must be an int >= 1 and lora_alpha a number")
        return cls(
            rank=rank,
            alpha=float(alpha),
            dropout=float(d.get("lora_dropout", 0.0)),
            targets=parse_targets(",".join(targets)),
        )


def expert_targets(targets: tuple[str, ...], model: ModelSpec) -> tuple[str, ...]:
    """The `targets` the MoE rule refuses on `model`: its MLP projections when they are routed
    experts (`NO_EXPERT_ADAPTERS`); none on a dense model."""
    if not model.is_moe:
        return ()
    return tuple(t for t in targets if t not in ATTENTION_MODULES)


def lora_spec(cfg: Any, model: ModelSpec) -> LoraSpec | None:
    """The run's `LoraSpec` from its trainer config (`lora_rank`, `lora_alpha`, `lora_dropout`,
    `lora_target_modules`; None when `lora_rank` is 0), checked against the model: routed
    experts take no adapter (ValueError naming the fix)."""
    if not cfg.lora_rank:
        return None
    targets = tuple(cfg.lora_target_modules)
    if bad := expert_targets(targets, model):
        raise ValueError(
            f"--lora-target-modules {' '.join(bad)}: {NO_EXPERT_ADAPTERS}; use "
            f"--lora-target-modules {' '.join(ATTENTION_MODULES)}"
        )
    return LoraSpec(
        rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=targets
    )


def peft_name(layer: int, module: str, which: str) -> str:
    """PEFT's state-dict key of one adapter matrix (`which`: 'A' or 'B')."""
    part = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"base_model.model.model.layers.{layer}.{part}.{module}.lora_{which}.weight"


def module_dims(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """{PEFT module: (d_in, d_out)} of one layer's projections."""
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    ffn = spec.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, ffn),
        "up_proj": (h, ffn),
        "down_proj": (ffn, h),
    }


def peft_shapes(spec: ModelSpec, lora: LoraSpec) -> dict[str, tuple[int, int]]:
    """{PEFT key: shape} of every adapter matrix of a model: r·(d_in + d_out) numbers per
    targeted projection and layer."""
    dims = module_dims(spec)
    out = {}
    for i in range(spec.num_layers):
        for m in lora.targets:
            d_in, d_out = dims[m]
            out[peft_name(i, m, "A")] = (lora.rank, d_in)
            out[peft_name(i, m, "B")] = (d_out, lora.rank)
    return out


_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""safetensors dtypes an adapter matrix may be stored in."""


def _shape_problems(
    shapes: dict[str, tuple[tuple[int, ...], bool]],
    lora: LoraSpec,
    spec: ModelSpec,
    *,
    max_rank: int | None,
    targets: tuple[str, ...] | None,
) -> list[str]:
    """What does not fit `spec` in an adapter of `lora` whose matrices have `shapes`
    ({key: (shape, floating)}): a rank above `max_rank`, targets outside `targets`, missing or
    unexpected keys, wrong shapes, non-floating dtypes (the first few)."""
    problems = []
    if max_rank is not None and lora.rank > max_rank:
        problems.append(f"rank {lora.rank} exceeds the engine's max LoRA rank {max_rank}")
    if targets is not None and (extra := set(lora.targets) - set(targets)):
        problems.append(f"targets {sorted(extra)} outside the engine's {list(targets)}")
    if bad := expert_targets(lora.targets, spec):
        problems.append(f"targets {list(bad)}: {NO_EXPERT_ADAPTERS}")
    want = peft_shapes(spec, lora)
    missing = sorted(set(want) - set(shapes))
    unexpected = sorted(set(shapes) - set(want))
    if missing:
        problems.append(f"{len(missing)} missing tensors (first: {missing[0]})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors (first: {unexpected[0]})")
    for k in sorted(set(want) & set(shapes)):
        shape, floating = shapes[k]
        if shape != want[k]:
            problems.append(f"{k} has shape {shape}, expected {want[k]}")
        elif not floating:
            problems.append(f"{k} is not stored as a floating type")
        if len(problems) >= 4:
            break
    return problems


def check_adapter(
    tensors: dict[str, torch.Tensor],
    lora: LoraSpec,
    spec: ModelSpec,
    *,
    max_rank: int | None = None,
    targets: tuple[str, ...] | None = None,
) -> None:
    """Refuse an adapter that does not fit `spec` (ValueError naming the first problems):
    a rank above `max_rank`, targets outside `targets`, missing/unexpected keys, wrong shapes,
    non-floating or non-finite values."""
    from slime_async.contracts.weights import all_finite

    shapes = {k: (tuple(t.shape), t.is_floating_point()) for k, t in tensors.items()}
    problems = _shape_problems(shapes, lora, spec, max_rank=max_rank, targets=targets)
    if not problems:
        problems = [
            f"{k} has non-finite values" for k, t in sorted(tensors.items()) if not all_finite(t)
        ][:4]
    if problems:
        raise ValueError("adapter refused: " + "; ".join(problems))


def adapter_dir(save_hf: str | Path) -> Path:
    """Where `--save-hf DIR` of a LoRA run puts the PEFT adapter: `DIR-adapter` beside it."""
    p = Path(save_hf)
    return p.with_name(p.name + "-adapter")


def write_peft_dir(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    lora: LoraSpec,
    *,
    version: int,
    base_model: str | None = None,
    finish: Callable[[Path], None] | None = None,
) -> Path:
    """Write a PEFT adapter directory at `path` atomically (a temp dir renamed into place), the
    version in the safetensors metadata and the weights' sha256 beside them; `finish(tmp)` runs
    last, before the rename (e.g. an ownership marker); returns the path."""
    import torch
    from safetensors.torch import save_file

    from slime_async.host import file_sha256

    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        data = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
        meta = {"format": "pt", "weight_version": str(version)}
        save_file(dict(sorted(data.items())), str(tmp / WEIGHTS_FILE), metadata=meta)
        cfg = lora.peft_config(base_model=base_model)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True))
        (tmp / CHECKSUM_FILE).write_text(file_sha256(tmp / WEIGHTS_FILE) + "\n")
        if finish is not None:
            finish(tmp)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_peft_dir(
    path: str | Path,
    *,
    model: ModelSpec | None = None,
    max_rank: int | None = None,
    targets: tuple[str, ...] | None = None,
) -> tuple[LoraSpec, dict[str, torch.Tensor], int]:
    """(spec, tensors, version) of a PEFT adapter directory; safetensors only (nothing is
    unpickled). With `model`, the safetensors header (names, shapes, dtypes) and the config's
    rank and targets are checked against it (`max_rank`, `targets`: the receiver's limits)
    before anything else is read; then the sha256 where the directory has one, then the
    tensors. Errors name the file."""
    from safetensors import safe_open

    from slime_async.host import file_sha256

    d = Path(path)
    cfg_file, weights = d / CONFIG_FILE, d / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(
            f"{d} is not a PEFT adapter directory: it needs {CONFIG_FILE} and {WEIGHTS_FILE} "
            "(adapter_model.bin is never read: it would be unpickled)"
        )
    try:
        lora = LoraSpec.from_peft_config(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
    if model is not None:
        shapes = _header_shapes(weights)
        if problems := _shape_problems(shapes, lora, model, max_rank=max_rank, targets=targets):
            raise ValueError(f"adapter refused ({weights}): " + "; ".join(problems))
    if (d / CHECKSUM_FILE).is_file():
        want = (d / CHECKSUM_FILE).read_text().strip()
        if file_sha256(weights) != want:
            raise ValueError(f"{weights} does not match its sha256 ({CHECKSUM_FILE})")
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(weights), framework="pt") as fh:
            version = int((fh.metadata() or {}).get("weight_version", 0))
            for k in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[k] = fh.get_tensor(k)
    except Exception as e:  # safetensors raises its own error type on a corrupt header
        raise ValueError(f"{weights} is not a readable safetensors file: {e}") from None
    return lora, tensors, version


def _header_shapes(weights: Path) -> dict[str, tuple[tuple[int, ...], bool]]:
    """{key: (shape, floating)} from the safetensors header of `weights`; reads no tensor."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as fh:
            out = {}
            for k in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                sl = fh.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype() in _FLOAT_DTYPES)
            return out
    except Exception as e:  # safetensors raises its own error type on a corrupt header
        raise ValueError(f"{weights} is not a readable safetensors file: {e}") from None


def adapter_numel(spec: ModelSpec, lora: LoraSpec) -> int:
    """Numbers in one adapter: Σ over layers and targets of r·(d_in + d_out)."""
    return sum(math.prod(s) for s in peft_shapes(spec, lora).values())
