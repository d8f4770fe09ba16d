"""`--save-hf DIR`: the trained model as a Hugging Face directory anyone can load.

Owns the save-hf directory scheme and its guards. `DIR` always holds the latest export (one
directory, no history: `--save` keeps the resumable history): `config.json`, safetensors
(sharded with `model.safetensors.index.json` above `weights_io.MAX_SHARD_SIZE`), and, when the
run started from an HF directory (`--hf-checkpoint` or its GGUF conversion), that directory's
tokenizer, chat template and `generation_config.json` with its BOS/EOS/PAD ids (see
`weights_io`). `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and, with a tokenizer,
`AutoTokenizer.from_pretrained(DIR)` load it.

A LoRA run also writes its PEFT adapter beside it, in `DIR-adapter` (`write_adapter`).

A save is written to a sibling `.DIR.tmp-XXXX`, then renamed over `DIR`: the previous export
stays until the new one is complete. The marker `slime_async_save_hf.json`, written last,
records the version, the source and the sha256 of every file (in `DIR-adapter`: the adapter
format); a non-empty directory without it is never replaced, neither `DIR` nor `DIR-adapter`:
refused when the flags are parsed (`target_errors`) and again before each save writes anything
(`check_writable`). Must never import the controller, engine, rollout or data-worker parts of
`slime_async`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from slime_async.contracts.adapter import (
    CHECKSUM_FILE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraSpec,
    adapter_dir,
    write_peft_dir,
)
from slime_async.contracts.weights import HFWeights
from slime_async.host import file_sha256
from slime_async.trainer import weights_io

if TYPE_CHECKING:
    import torch

MARKER = "slime_async_save_hf.json"
FORMAT = "slime_async.save_hf/1"
ADAPTER_FORMAT = "slime_async.save_hf_adapter/1"
"""The marker's format in `DIR-adapter`."""
_CKPT_ENTRY = re.compile(r"^(iter_\d{7}|latest|\.tmp-.*)$")
"""Names `--save` writes at its top level (`trainer.checkpoint`)."""


def _marker_format(d: Path) -> str | None:
    try:
        return json.loads((d / MARKER).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def is_save_hf_dir(d: Path) -> bool:
    """True when `d` was written by `--save-hf` (its marker names our format)."""
    return _marker_format(d) == FORMAT


def is_save_hf_adapter_dir(d: Path) -> bool:
    """True when `d` was written by `--save-hf` as a LoRA run's adapter: its marker, or (written
    before the marker was) exactly the three files `write_peft_dir` writes, the weights matching
    the sha256 beside them."""
    if _marker_format(d) == ADAPTER_FORMAT:
        return True
    try:
        names = {f.name for f in d.iterdir()}
        if names != {CONFIG_FILE, WEIGHTS_FILE, CHECKSUM_FILE}:
            return False
        return file_sha256(d / WEIGHTS_FILE) == (d / CHECKSUM_FILE).read_text().strip()
    except OSError:
        return False


def _ownership_errors(out: Path, *, adapter: bool) -> list[str]:
    """Why `out` (the export, or with `adapter` its adapter directory) may not be replaced: a
    file there, or a non-empty directory `--save-hf` did not write."""
    if adapter:
        what, ours = f"the LoRA adapter directory {out} (beside --save-hf)", is_save_hf_adapter_dir
    else:
        what, ours = f"--save-hf {out}", is_save_hf_dir
    if out.exists() and not out.is_dir():
        return [f"{what} is a file; give --save-hf a directory where it is free"]
    if out.is_dir() and any(out.iterdir()) and not ours(out):
        return [
            f"{what} is a non-empty directory not written by --save-hf (no {MARKER}); refusing "
            "to replace it: give --save-hf a new or empty directory"
        ]
    return []


def check_writable(out: str | Path, *, lora: bool) -> None:
    """Refuse (FileExistsError) a save into `out`, or with `lora` into its adapter directory,
    that would replace what `--save-hf` did not write; called before anything is written."""
    errors = _ownership_errors(Path(out), adapter=False)
    if lora:
        errors += _ownership_errors(adapter_dir(out), adapter=True)
    if errors:
        raise FileExistsError("; ".join(errors))


def write(
    weights: HFWeights,
    out: str | Path,
    *,
    source: str | Path | None,
    dtype: torch.dtype | None = None,
    transform: weights_io.Transform | None = None,
) -> Path:
    """Write `weights` into `out` (replacing a previous save-hf export there), tensor by tensor
    (each through `transform`, cast to `dtype` when given: `weights_io.write_hf_dir`); returns
    `out`."""
    out = Path(out)
    check_writable(out, lora=False)

    def mark(tmp: Path) -> None:
        files = {
            f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
            for f in sorted(tmp.iterdir())
            if f.is_file()
        }
        marker = {
            "format": FORMAT,
            "version": weights.version,
            "source": None if source is None else str(source),
            "spec": weights.spec.to_dict(),
            "files": files,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))

    return weights_io.write_hf_dir(
        weights, out, dtype=dtype, source=source, finish=mark, transform=transform
    )


def write_adapter(
    tensors: dict[str, torch.Tensor],
    lora: LoraSpec,
    out: str | Path,
    *,
    version: int,
    base_model: str | None,
) -> Path:
    """Write a LoRA run's PEFT adapter into `out` (`DIR-adapter`; replacing only what
    `--save-hf` wrote there), its marker last; returns `out`."""
    out = Path(out)
    errors = _ownership_errors(out, adapter=True)
    if errors:
        raise FileExistsError("; ".join(errors))

    def mark(tmp: Path) -> None:
        marker = {"format": ADAPTER_FORMAT, "version": version, "base_model": base_model}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))

    return write_peft_dir(out, tensors, lora, version=version, base_model=base_model, finish=mark)


def verify(d: Path) -> str | None:
    """None when every file the marker lists has its recorded size and sha256, else why not."""
    if not is_save_hf_dir(d):
        return f"{d} is not a --save-hf directory (no {MARKER})"
    files = json.loads((d / MARKER).read_text())["files"]
    for name, info in files.items():
        f = d / name
        if not f.is_file():
            return f"missing file {f}"
        if f.stat().st_size != info["bytes"] or file_sha256(f) != info["sha256"]:
            return f"{f} does not match its recorded size/sha256"
    return None


def _inside(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def target_errors(out: str, *, paths: dict[str, str | None], lora: bool = False) -> list[str]:
    """Why `--save-hf out` cannot be written, given the run's other paths (flag -> path):
    replacing `out` (with `lora` also its adapter directory, `out-adapter`) must delete none of
    them, it must not take a name `--save` uses, and a non-empty directory there must be a
    previous `--save-hf` output (never user data)."""
    o = Path(out).resolve()
    errors = _ownership_errors(o, adapter=False)
    replaced = {o: f"--save-hf {out}"}
    if lora:
        errors += _ownership_errors(adapter_dir(o), adapter=True)
        replaced[adapter_dir(o)] = f"the LoRA adapter directory {adapter_dir(o)} (beside --save-hf)"
    for flag, p in paths.items():
        if not p:
            continue
        other = Path(p).resolve()
        if hit := next((what for r, what in replaced.items() if _inside(other, r)), None):
            errors.append(
                f"{hit} contains {flag} {p}, which replacing it would delete; give --save-hf a "
                f"directory outside {p}"
            )
        elif flag == "--save" and o.parent == other and _CKPT_ENTRY.match(o.name):
            errors.append(
                f"--save-hf {out} takes the name {o.name!r} that --save {p} uses for its "
                f"checkpoints; pick another name (e.g. {other / 'hf'})"
            )
        elif flag == "--run-dir" and _inside(o, other / "weights"):
            errors.append(
                f"--save-hf {out} is inside {other / 'weights'}, where the weight pushes are "
                "written and pruned; pick another directory (e.g. <run-dir>/hf)"
            )
    return errors
