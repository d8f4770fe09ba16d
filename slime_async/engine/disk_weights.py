"""Reading a checkpoint directory for `/update_weights_from_disk`: checked before it can
serve, at the least cost for a wrong file.

Owns: `read_weights_from_disk` (safetensors headers checked against the served model's export
signature before any tensor is read, every stored value finite, then loaded with
`from_pretrained` and checked again), `disk_signature` (what an export of the served model
holds on disk, cached per model). The swap itself is `model.swap_weights`. Must never import
the server, the scheduler or aiohttp.
"""

from __future__ import annotations

import tempfile
import weakref
from pathlib import Path

import torch

from slime_async.contracts.weights import all_finite
from slime_async.engine.model import LoadedModel

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
"""safetensors dtypes a weight file may hold (cast to the serving dtype on load)."""
_DISK_SIGNATURES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)


def _read_headers(d: Path) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """name -> (shape, safetensors dtype, file name) from every `*.safetensors` header in `d`;
    reads no tensor data. Raises `ValueError` on an unreadable header or a name in two files."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, tuple[tuple[int, ...], str, str]] = {}
    for f in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    sl = h.get_slice(k)
                    if k in out:
                        raise ValueError(f"tensor {k!r} appears in both {out[k][2]} and {f.name}")
                    out[k] = (tuple(sl.get_shape()), sl.get_dtype(), f.name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"unreadable safetensors header in {f.name}: {e}") from None
    return out


def disk_signature(lm: LoadedModel) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes a `save_pretrained` export of the served model holds on disk
    (HF may store tensors under other names than it serves them, e.g. per-expert vs fused).
    Read from the served `model_dir`'s headers, else from one export of the served model to a
    temporary directory; cached per model."""
    sig = _DISK_SIGNATURES.get(lm.model)
    if sig is None:
        src = Path(lm.model_path)
        if not (src.is_dir() and any(src.glob("*.safetensors"))):
            with tempfile.TemporaryDirectory() as tmp:
                lm.model.save_pretrained(tmp)
                sig = {k: v[0] for k, v in _read_headers(Path(tmp)).items()}
        else:
            sig = {k: v[0] for k, v in _read_headers(src).items()}
        _DISK_SIGNATURES[lm.model] = sig
    return sig


def _check_finite(d: Path) -> None:
    """Raise `ValueError` naming the file and tensor if any stored value is NaN or inf; reads one
    tensor at a time from the memory-mapped files (bounded memory)."""
    from safetensors import safe_open

    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                t = h.get_tensor(k)
                if not all_finite(t):
                    bad = int((~torch.isfinite(t)).sum())
                    raise ValueError(
                        f"tensor {k!r} in {f.name} holds {bad} non-finite value(s) (NaN or inf); "
                        "refusing to serve it, the old weights stay"
                    )


def _check_headers(lm: LoadedModel, p: Path, path: str) -> None:
    """Every file's header (names, shapes, float dtypes) against the served model's export
    signature, before any tensor is read; raises `ValueError` naming up to five problems."""
    try:
        headers = _read_headers(p)
    except ValueError as e:
        raise ValueError(f"could not load weights from {path!r}: {e}") from None
    want = disk_signature(lm)
    problems = [f"missing tensor {k!r}" for k in sorted(want.keys() - headers.keys())]
    problems += [
        f"unexpected tensor {k!r} in {headers[k][2]}" for k in sorted(headers.keys() - want.keys())
    ]
    for k in sorted(want.keys() & headers.keys()):
        shape, dtype, fname = headers[k]
        if shape != want[k]:
            problems.append(f"{k!r} in {fname} has shape {shape}, the served model {want[k]}")
        elif dtype not in _FLOAT_DTYPES:
            problems.append(f"{k!r} in {fname} has dtype {dtype}, not a float type")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(
            f"weights in {path!r} do not fit the served model: {'; '.join(problems[:5])}{more}; "
            "export from the same ModelSpec"
        )


def read_weights_from_disk(lm: LoadedModel, path: str) -> dict[str, torch.Tensor]:
    """Load a weights directory (HF `config.json` + safetensors, as `save_pretrained` writes it)
    and check that it fits the served model. Returns the state dict in the serving dtype.

    Checked in this order, so a wrong file costs no memory: (1) every file's header (names,
    shapes, float dtypes) against the served model's export signature, before any tensor is
    read or any model built; (2) after loading (one model's worth of memory in the serving
    dtype, the copy the swap needs), every tensor is finite. Raises `ValueError` naming the file
    and tensor; touches nothing that is serving.
    """
    from slime_async.engine.model import auto_class

    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model_path {path!r} is not a directory")
    if not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise ValueError(
            f"model_path {path!r} must hold config.json and *.safetensors (HF save_pretrained layout)"
        )
    _check_headers(lm, p, path)
    _check_finite(p)
    try:
        new = auto_class(lm.model.config.model_type).from_pretrained(str(p), dtype=lm.dtype)
    except Exception as e:  # corrupt file, bad config, ...: report, keep serving
        raise ValueError(f"could not load weights from {path!r}: {type(e).__name__}: {e}") from e
    sd = new.state_dict()
    del new
    got = {k: tuple(v.shape) for k, v in sd.items()}
    if got != lm.state_signature():
        raise ValueError(
            f"weights in {path!r} load into another architecture than the served model "
            "(its config.json differs); export from the same ModelSpec"
        )
    for k, t in sd.items():
        if not all_finite(t):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(
                f"tensor {k!r} (from {path!r}) holds {bad} non-finite value(s) (NaN or inf) in "
                f"{lm.dtype}; refusing to serve it, the old weights stay"
            )
    return sd
