"""What a run reads, checked when its flags are parsed: before Ray or any role starts, every
local path a flag names exists and is what the flag takes, and a Hugging Face Hub id is refused
at once with the command that downloads it (the run reads local files only; it never
downloads).

Owns `check_inputs` (every path flag at once: --hf-checkpoint, --ref-load, --prompt-data,
--eval-prompt-data, --custom-rm-path; one line per problem) and `hub_hint`. What --ref-load
holds (`megatron_ckpt.WeightsDir`: an HF directory or a Megatron torch_dist checkpoint) is
returned for the run's rules; --load's directory is `trainer.checkpoint.inspect_load`'s.
Touches the filesystem (and imports a --custom-rm-path module, as --custom-generate-function-path
is imported at parse time): called by `slime_async.config.read_environment` only.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from pathlib import Path

from slime_async.trainer.megatron_ckpt import WeightsDir, weights_dir

__all__ = ["check_inputs", "hub_hint"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""`org/name`: how a Hugging Face Hub repository is named."""
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq", ".ndjson", ".gguf", ".txt", ".csv")


def hub_hint(flag: str, value: str, *, dataset: bool = False) -> str:
    """Why `value` (no such local path) is refused: with the download command when it could
    be a Hub id (`org/name`, no file suffix)."""
    if not _HUB_ID.match(value) or Path(value).suffix.lower() in _FILE_SUFFIXES:
        return f"{flag} {value} does not exist"
    name = value.rsplit("/", 1)[1]
    local = f"data/{name}" if dataset else f"models/{name}"
    kind = " --repo-type dataset" if dataset else ""
    return (
        f"{flag} {value} does not exist here; if it names a Hugging Face Hub repository, "
        f"download it first (this run reads local files only): `hf download {value}{kind} "
        f"--local-dir {local}` (older huggingface_hub: `huggingface-cli download`), then give "
        f"{flag} {local}" + ("/<file>.jsonl" if dataset else "")
    )


def _hf_checkpoint(value: str | None) -> list[str]:
    if value is None or value.endswith(".gguf") or Path(value).exists():
        return []  # what it holds is read next (its config.json; a GGUF file, maybe packaged)
    return [hub_hint("--hf-checkpoint", value)]


def _ref_load(value: str | None) -> tuple[WeightsDir | None, list[str]]:
    if value is None:
        return None, []
    if not Path(value).exists():
        return None, [hub_hint("--ref-load", value)]
    found = weights_dir(Path(value))
    if isinstance(found, str):
        return None, [f"--ref-load {value} {found}"]
    return found, []


def _data_files(a: argparse.Namespace) -> list[str]:
    """--prompt-data and each --eval-prompt-data file exist (the files are read at start-up,
    with the tokenizer)."""
    from slime_async.rollout.config import parse_eval_prompt_data

    files = [("--prompt-data", a.prompt_data)] if a.prompt_data else []
    with contextlib.suppress(ValueError):  # a malformed list: the rollout rule refuses it
        pairs = parse_eval_prompt_data(tuple(a.eval_prompt_data or ()))
        files += [(f"--eval-prompt-data {name}", p) for name, p in pairs]
    errors = []
    for flag, path in files:
        p = Path(path)
        if p.is_dir():
            errors.append(f"{flag} {path} is a directory; give a .jsonl or .parquet file")
        elif not p.is_file():
            errors.append(hub_hint(flag, path, dataset=True))
    return errors


def _reward(path: str | None) -> list[str]:
    """--custom-rm-path resolves to a callable now, not at the first scored sample."""
    if path is None:
        return []
    from slime_async.rollout.data.rewards import load_reward_fn

    try:
        load_reward_fn(path)
    except (ImportError, ValueError) as e:
        return [f"--custom-rm-path {path}: {e}"]
    return []


def check_inputs(a: argparse.Namespace) -> WeightsDir | None:
    """Every path the run reads, checked now; returns what --ref-load holds (None without it).
    Raises ValueError with one line per problem."""
    ref, errors = _ref_load(a.ref_load)
    errors = _hf_checkpoint(a.hf_checkpoint) + errors + _data_files(a) + _reward(a.custom_rm_path)
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError("what the run would read is missing:\n  - " + "\n  - ".join(errors))
    return ref
