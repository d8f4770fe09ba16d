"""`--save-hf DIR`: the trained model as a Hugging Face directory anyone can load.

Owns the save-hf directory scheme and its guards. `DIR` always holds the latest export (one
directory, no history: `--save` keeps the resumable history): `config.json`, safetensors
(sharded with `model.safetensors.index.json` above `weights_io.MAX_SHARD_SIZE`), and, when the
run started from an HF directory (`--hf-checkpoint` or its GGUF conversion), that directory's
tokenizer, chat template and `generation_config.json` with its BOS/EOS/PAD ids (see
`weights_io`). `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and, with a tokenizer,
`AutoTokenizer.from_pretrained(DIR)` load it.

A save is written to a sibling `.DIR.tmp-XXXX`, then renamed over `DIR`: the previous export
stays until the new one is complete. The marker `slime_async_save_hf.json`, written last,
records the version, the source and the sha256 of every file; a non-empty directory without it
is never written into (`target_errors`). Must never import the controller, engine, rollout or
data-worker parts of `slime_async`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from slime_async.contracts.weights import HFWeights
from slime_async.host import file_sha256
from slime_async.trainer import weights_io

MARKER = "slime_async_save_hf.json"
FORMAT = "slime_async.save_hf/1"
_CKPT_ENTRY = re.compile(r"^(iter_\d{7}|latest|\.tmp-.*)$")
"""Names `--save` writes at its top level (`trainer.checkpoint`)."""


def is_save_hf_dir(d: Path) -> bool:
    """True when `d` was written by `--save-hf` (its marker names our format)."""
    try:
        return json.loads((d / MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def write(weights: HFWeights, out: str | Path, *, source: str | Path | None) -> Path:
    """Write `weights` into `out` (replacing a previous save-hf export there); returns `out`."""
    out = Path(out)
    if out.exists() and not is_save_hf_dir(out) and any(out.iterdir()):
        raise FileExistsError(
            f"--save-hf {out} holds files not written by --save-hf; refusing to replace them"
        )

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

    return weights_io.write_hf_dir(weights, out, source=source, finish=mark)


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


def target_errors(out: str, *, paths: dict[str, str | None]) -> list[str]:
    """Why `--save-hf out` cannot be written, given the run's other paths (flag -> path):
    replacing `out` must delete none of them, it must not take a name `--save` uses, and a
    non-empty directory there must be a previous `--save-hf` output (never user data)."""
    o = Path(out).resolve()
    errors = []
    if o.exists() and not o.is_dir():
        errors.append(f"--save-hf {out} is a file; give a directory")
    elif o.is_dir() and any(o.iterdir()) and not is_save_hf_dir(o):
        errors.append(
            f"--save-hf {out} is a non-empty directory not written by --save-hf (no {MARKER}); "
            "refusing to replace it: give a new or empty directory"
        )
    for flag, p in paths.items():
        if not p:
            continue
        other = Path(p).resolve()
        if _inside(other, o):
            errors.append(
                f"--save-hf {out} contains {flag} {p}, which replacing it would delete; give "
                f"--save-hf a directory outside {p}"
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
