"""HF-format weight directories on disk: atomic write (export) and read (import).

Owns: the on-disk contract between trainer and engines — a directory with HF `config.json`
plus `model.safetensors` holding the tensor names `transformers` writes with `save_pretrained`,
written to a temp dir and renamed into place. The weight version is recorded in the
safetensors metadata (`weight_version`). Must never import the controller, engine, rollout or
data-worker parts of `slime_async`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weights import HFWeights

WEIGHTS_FILE = "model.safetensors"


def _hf_config_dict(spec: ModelSpec) -> dict[str, object]:
    cfg = spec.to_hf_config()
    cfg.architectures = [spec.hf_architecture]
    d = cfg.to_dict()
    d["dtype"] = "float32"
    return d


def atomic_replace_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written `tmp` directory onto `final` (replacing an old one)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_hf_dir(weights: HFWeights, path: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write `weights` as an HF checkpoint directory at `path`, atomically; returns the path.

    `dtype` (default: keep fp32) casts floating tensors, e.g. torch.bfloat16 to halve the size.
    """
    from safetensors.torch import save_file

    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        tensors = {
            k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
            for k, v in sorted(weights.tensors.items())
        }
        cfg = _hf_config_dict(weights.spec)
        if dtype is not None:
            cfg["dtype"] = str(dtype).removeprefix("torch.")
        meta = {"format": "pt", "weight_version": str(weights.version)}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=meta)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        atomic_replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def read_hf_dir(path: str | Path) -> HFWeights:
    """Read an HF checkpoint directory (`config.json` + `*.safetensors`) into `HFWeights`.

    Accepts what `save_pretrained` writes (one file or shards). The version is the metadata
    `weight_version` when present, else 0.
    """
    from safetensors import safe_open

    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"{d} is not an HF checkpoint directory: {cfg_path} is missing "
            "(pass a directory written by save_pretrained or by the trainer's export)"
        )
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}; only safetensors are read")
    spec = ModelSpec.from_hf_config(json.loads(cfg_path.read_text()))
    tensors: dict[str, torch.Tensor] = {}
    version = 0
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            meta = fh.metadata() or {}
            version = int(meta.get("weight_version", version))
            for k in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[k] = fh.get_tensor(k)
    return HFWeights(version=version, spec=spec, tensors=tensors)
