"""Atomic, guarded training checkpoints (save / find latest / load with resume guards).

One responsibility, the checkpoint directory format: writing it, validating it and reading it
back under every resume guard. Must never import the controller, engine, rollout or
data-worker parts of `slime_async`.

Layout of `<save>/`::

    iter_0000012/            one complete checkpoint (renamed into place when complete)
        meta.json            ckpt_format, version, ModelSpec, parallel layout, optimizer step,
                             LR schedule (the LR is a pure function of version + schedule), sizes
                             and sha256 of every file below, opaque `extra_state` (controller,
                             data worker), and `meta_sha256` over all of it
        dist/                --ckpt-format torch_dist (`dist_ckpt`): every rank's shards of the
                             weights and of the Adam moments (+ fp32 main params under bf16),
                             written by megatron's dist_checkpointing; nothing is gathered
        model.pt             --ckpt-format torch: full HF-named fp32 weights
        optim.pt             --ckpt-format torch: full HF-named Adam moments `exp_avg` /
                             `exp_avg_sq` (and the fp32 `main_param` under bf16), gathered over
                             DP from the distributed optimizer's shards
                             (`optim.MegatronOptim.state_tensors`)
        rng_rank00000.pt     per-rank torch + megatron-tracker RNG states
    latest                   text "12", replaced atomically after the rename
    .tmp-iter_0000013/       a save in progress / crashed: never read

Either format loads under any TP/EP/PP/DP layout, with or without the distributed optimizer:
`torch` tensors are full (the HF export's mapping), `torch_dist` tensors are resharded by
dist_checkpointing. `load` reads the format meta.json names (absent: torch), whatever
--ckpt-format says. `torch` files are read with `torch.load(..., weights_only=True)`; a
`torch_dist` load unpickles dist_checkpointing's `dist/.metadata`, so every file's sha256 is
checked against meta.json first (docs/security.md).

Guards (each raises `CheckpointError` naming the path): `--load` missing, empty or without a
complete checkpoint (never a fallback to `--hf-checkpoint`/`--ref-load`); a loaded iteration
of 0; a checkpoint of another ModelSpec. `inspect_load` reads the same facts at start-up (no
sha256 of the tensor files) so that the run's config refuses them before anything starts; an
empty `--load` is the config's to allow (slime's `--load D --save D`), never this module's. A
partial or corrupted directory (missing file, size or sha256 mismatch, unreadable meta) is never
picked: `latest` falls back to the newest complete checkpoint and says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from slime_async.contracts.model import ModelSpec
from slime_async.host import atomic_write_text, file_sha256
from slime_async.trainer import dist_ckpt, hf_convert, lora
from slime_async.trainer.megatron_ckpt import WeightsDir, weights_dir
from slime_async.trainer.model import global_named_parameters
from slime_async.trainer.parallel import ParallelLayout


class TrainerState(Protocol):
    """What a checkpoint saves and restores of one trainer rank (`MegatronTrainer` is one).
    Declared here so that this module never imports the trainer (which calls into it)."""

    cfg: Any
    spec: ModelSpec
    layout: ParallelLayout
    chunks: list[torch.nn.Module]
    optim: Any  # optim.MegatronOptim
    rank: int
    world_size: int
    version: int
    extra_state: dict[str, object]
    resumed_layout: ParallelLayout | None


log = logging.getLogger(__name__)
FORMAT = "slime_async.trainer.checkpoint/1"
_ITER = re.compile(r"^iter_(\d{7})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this resume (message names the path and the fix)."""


def iter_name(version: int) -> str:
    return f"iter_{version:07d}"


def check_spec(found: ModelSpec, expected: ModelSpec, *, where: str) -> None:
    """Refuse weights of another architecture, listing the differing fields."""
    if found == expected:
        return
    a, b = found.to_dict(), expected.to_dict()
    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    raise CheckpointError(
        f"{where} holds weights of another model config; differing fields "
        f"(checkpoint, this run): {diff}. Use the checkpoint's ModelSpec or another checkpoint."
    )


def _meta_digest(meta: dict[str, object]) -> str:
    """sha256 of meta.json's content without its own `meta_sha256` field (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_meta(ckpt: Path) -> dict[str, object]:
    """`ckpt/meta.json`, checked: a JSON object whose `meta_sha256` matches its content (so the
    data-worker state and every recorded file checksum inside it are covered too). Raises
    `CheckpointError` naming the file otherwise."""
    path = ckpt / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"unreadable {path}: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(meta).__name__}, not the checkpoint's "
            "object (edited or corrupted)"
        )
    if "meta_sha256" not in meta:
        raise CheckpointError(
            f"{path} has no meta_sha256: it was written before checkpoint metadata was "
            "checksummed, or the field was removed; resume from a checkpoint saved by this version"
        )
    if meta.get("meta_sha256") != _meta_digest(meta):
        raise CheckpointError(
            f"{path} fails its checksum (meta_sha256): it was edited or corrupted after the save "
            "(it holds the data-worker state and every file's sha256, so it is never trusted "
            "unchecked); resume from another checkpoint"
        )
    return meta


def _barrier(tr: TrainerState) -> None:
    if dist.is_initialized() and tr.world_size > 1:
        dist.barrier()


def _optimizer_moments(tr: TrainerState) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """HF-named full optimizer state (collective over DP, TP, EP, PP) and Adam's step count."""
    if getattr(tr, "lora", None) is not None:  # only the adapters train (PEFT keys)
        full = lora.optimizer_moments(tr.optim, tr.chunks, tr.spec, tr.lora)
        return full, tr.optim.step_count()
    local = tr.optim.state_tensors(global_named_parameters(tr.chunks))
    full = {k: hf_convert.megatron_to_hf_tensors(v, tr.spec) for k, v in local.items()}
    return full, tr.optim.step_count()


def save(tr: TrainerState, save_dir: Path, *, extra_state: dict[str, object]) -> Path:
    """Write `iter_<version>` atomically in `tr.cfg.checkpoint_format`, then point `latest` at
    it; returns the final path."""
    json.dumps(extra_state)  # fail early (TypeError) if the opaque state is not JSON-able
    fmt = tr.cfg.checkpoint_format
    weights = moments = adapter = None
    opt_step = tr.optim.step_count()
    if fmt == "torch":  # gathered: collective over TP/EP/PP/DP, full tensors on rank 0
        weights = hf_convert.megatron_to_hf(tr.chunks, tr.spec)  # with LoRA: the base
        adapter = tr.export_adapter() if getattr(tr, "lora", None) is not None else None
        moments, opt_step = _optimizer_moments(tr)
    final = save_dir / iter_name(tr.version)
    tmp = save_dir / f".tmp-{iter_name(tr.version)}"
    if tr.rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(tr)
    torch.save(_rng_states(), tmp / f"rng_rank{tr.rank:05d}.pt")
    if fmt == "torch_dist":
        dist_ckpt.save(tr, tmp)  # every rank its own shards, into tmp/dist/
    elif tr.rank == 0:
        torch.save(weights, tmp / "model.pt")
        torch.save(moments, tmp / "optim.pt")
        if adapter is not None:
            torch.save(adapter, tmp / "adapter.pt")
    _barrier(tr)
    if tr.rank == 0:
        meta = _meta(
            tr, tmp, fmt=fmt, opt_step=opt_step, with_adapter=adapter is not None, extra=extra_state
        )
        atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=2, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_text(save_dir / "latest", f"{tr.version}\n")
        _prune(save_dir, keep=tr.cfg.keep_checkpoints, current=final)
    _barrier(tr)
    return final


def _rng_states() -> dict[str, object]:
    """This rank's torch, megatron-tracker (and CUDA) RNG states."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    rng = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def _meta(
    tr: TrainerState,
    tmp: Path,
    *,
    fmt: object,
    opt_step: int,
    with_adapter: bool,
    extra: dict[str, object],
) -> dict[str, object]:
    """meta.json of the checkpoint written into `tmp`: sizes and sha256 of its files, and
    `meta_sha256` over all of it."""
    files = {
        f.relative_to(tmp).as_posix(): {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
        for f in sorted(tmp.rglob("*"))
        if f.is_file()
    }
    meta = {
        "format": FORMAT,
        "ckpt_format": fmt,
        "version": tr.version,
        "spec": tr.spec.to_dict(),
        "layout": tr.layout.to_dict(),
        "world_size": tr.world_size,
        "optimizer_step": opt_step,
        "optimizer": {"distributed": tr.optim.distributed, "bf16": tr.optim.bf16},
        "lr_schedule": _lr_schedule(tr),
        "lora": tr.lora.peft_config() if with_adapter else None,
        "extra_state": extra,
        "files": files,
    }
    meta["meta_sha256"] = _meta_digest(meta)
    return meta


def _prune(save_dir: Path, *, keep: int, current: Path) -> None:
    """Delete all but the newest `keep` finished checkpoints (meta.json present; no hashing)."""
    complete = [d for d in _iter_dirs(save_dir) if (d / "meta.json").is_file()]
    for d in complete[:-keep] if keep > 0 else []:
        if d != current:
            shutil.rmtree(d, ignore_errors=True)


def _iter_dirs(save_dir: Path) -> list[Path]:
    dirs = [d for d in save_dir.iterdir() if d.is_dir() and _ITER.match(d.name)]
    return sorted(dirs, key=lambda d: int(_ITER.match(d.name).group(1)))


def validate(ckpt: Path, *, hashes: bool = True) -> str | None:
    """None if `ckpt` is a complete checkpoint, else the reason it is not. `hashes=False` checks
    meta.json (its own checksum included) and every file's presence and size, not the files'
    sha256 (start-up's quick look; the trainer's load checks them all)."""
    meta_path = ckpt / "meta.json"
    try:
        meta = read_meta(ckpt)
    except CheckpointError as e:
        return str(e)
    if meta.get("format") != FORMAT:
        return f"{meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}"
    files = meta.get("files")
    if not isinstance(files, dict):
        return f"{meta_path} lists no files"
    for name, info in files.items():
        f = ckpt / name
        if not f.is_file():
            return f"missing file {f}"
        if f.stat().st_size != info["bytes"]:
            return f"{f} has {f.stat().st_size} bytes, meta.json says {info['bytes']} (truncated)"
        if hashes and file_sha256(f) != info["sha256"]:
            return f"{f} fails its sha256 check (corrupted)"
    fmt = ckpt_format(meta)
    needs = REQUIRED.get(fmt)
    if needs is None:
        return f"{meta_path} has ckpt_format {fmt!r}, expected one of {sorted(REQUIRED)}"
    if needs not in files:
        return f"{ckpt} has no {needs} (a {fmt} checkpoint)"
    return None


REQUIRED = {"torch": "model.pt", "torch_dist": f"{dist_ckpt.SUBDIR}/.metadata"}
"""The file each `--ckpt-format` cannot be without."""


def ckpt_format(meta: dict[str, object]) -> object:
    """The checkpoint's `--ckpt-format` (checkpoints written before the field: torch)."""
    return meta.get("ckpt_format", "torch")


def find_latest(load_dir: Path, *, hashes: bool = True) -> Path:
    """The complete checkpoint to resume from in `load_dir` (a save dir or an iter dir)."""
    if not load_dir.is_dir():
        raise CheckpointError(
            f"--load {load_dir} does not exist or is not a directory; refusing to start from "
            "--hf-checkpoint/--ref-load or random weights. Fix the path, or drop --load to "
            "start a new run."
        )
    if (load_dir / "meta.json").exists():
        reason = validate(load_dir, hashes=hashes)
        if reason:
            raise CheckpointError(f"--load {load_dir} is not a usable checkpoint: {reason}")
        return load_dir
    pointer = load_dir / "latest"
    if pointer.is_file():
        try:
            cand = load_dir / iter_name(int(pointer.read_text().strip()))
            reason = validate(cand, hashes=hashes)
        except ValueError:
            cand, reason = None, f"unreadable pointer {pointer}"
        if reason is None and cand is not None:
            return cand
        log.warning(
            "checkpoint pointer %s is not usable (%s); looking for older ones", pointer, reason
        )
    complete = [d for d in _iter_dirs(load_dir) if validate(d, hashes=hashes) is None]
    if complete:
        log.warning("resuming from %s, the newest complete checkpoint", complete[-1])
        return complete[-1]
    found = sorted(p.name for p in load_dir.iterdir())
    other = weights_dir(load_dir)
    why = f" ({other})" if isinstance(other, str) and "Megatron" in other else ""
    raise CheckpointError(
        f"--load {load_dir} holds no complete checkpoint (contents: {found[:10]}){why}; "
        "refusing to start from --hf-checkpoint/--ref-load or random weights. Point --load at "
        "a directory written by --save, a Megatron torch_dist checkpoint or a Hugging Face "
        "directory (weights to start from), or drop --load to start a new run."
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LoadFacts:
    """What `--load`'s directory holds (`inspect_load`, at start-up)."""

    path: str
    """The directory, as given."""
    empty: bool = False
    """Missing or empty: nothing saved there yet."""
    exists: bool = True
    """The path exists."""
    problem: str | None = None
    """Why it cannot be resumed (not empty, but no usable checkpoint)."""
    checkpoint: str | None = None
    """The complete checkpoint a resume loads."""
    version: int | None = None
    """Its train version."""
    spec: dict[str, Any] | None = None
    """Its `ModelSpec`, as saved."""
    step: int | None = None
    """The controller's step in its extra state."""
    has_worker_state: bool = False
    """It holds the data worker's state (written by train_async.py)."""
    weights: WeightsDir | None = None
    """It holds no checkpoint of train_async.py but weights (a Megatron torch_dist checkpoint,
    e.g. slime's, or an HF directory): a run starts from them, it does not resume."""
    batch_shape: Any = None
    """The batch shape it was trained with (None: not recorded)."""


def holds_no_checkpoint_yet(load_dir: Path) -> bool:
    """`load_dir` is missing, or an empty directory (a crashed first save's `.tmp-iter_*`
    aside): a run with --save there has saved nothing yet."""
    if not load_dir.exists():
        return True
    return load_dir.is_dir() and all(p.name.startswith(".tmp-") for p in load_dir.iterdir())


def inspect_load(load_dir: Path) -> LoadFacts:
    """What `--load load_dir` holds, read once at start-up so that every refusal about it comes
    before anything starts. No sha256 of the tensor files: the trainer's `load` checks them."""
    if holds_no_checkpoint_yet(load_dir):
        return LoadFacts(path=str(load_dir), empty=True, exists=load_dir.exists())
    try:
        ckpt = find_latest(load_dir, hashes=False)
        meta = read_meta(ckpt)
    except CheckpointError as e:
        found = weights_dir(load_dir)
        if isinstance(found, WeightsDir):
            return LoadFacts(path=str(load_dir), weights=found)
        return LoadFacts(path=str(load_dir), problem=str(e))
    extra = meta.get("extra_state") or {}
    return LoadFacts(
        path=str(load_dir),
        checkpoint=str(ckpt),
        version=int(meta["version"]),
        spec=meta["spec"],
        step=extra.get("step"),
        has_worker_state="worker" in extra,
        batch_shape=extra.get("batch_shape"),
    )


def load(tr: TrainerState, load_dir: Path) -> dict[str, object]:
    """Restore `tr` from the latest complete checkpoint in `load_dir`; returns meta.json."""
    ckpt = find_latest(load_dir)
    meta = read_meta(ckpt)
    if int(meta["version"]) == 0:
        raise CheckpointError(
            f"--load {load_dir}: checkpoint {ckpt.name} is iteration 0 (untrained initial "
            "weights). Resuming it would push initial weights to the engines as if trained; "
            "start a new run with --hf-checkpoint instead of --load."
        )
    check_spec(ModelSpec.from_dict(meta["spec"]), tr.spec, where=f"--load {ckpt}")
    if meta.get("lr_schedule") not in (None, _lr_schedule(tr)):
        log.warning(
            "LR schedule differs from checkpoint %s (saved %s, now %s); the new flags apply "
            "from version %s on",
            ckpt,
            meta["lr_schedule"],
            _lr_schedule(tr),
            meta["version"],
        )
    saved = ParallelLayout(**{"etp": meta["layout"]["tp"], **meta["layout"]})  # etp: TP before
    if saved != tr.layout:
        log.warning("resharding checkpoint %s from layout %s to %s", ckpt, saved, tr.layout)
    mine = getattr(tr, "lora", None)
    try:
        lora.check_checkpoint(meta.get("lora"), mine, where=f"--load {ckpt}")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if ckpt_format(meta) == "torch_dist":
        _check_dist_precision(meta, tr, ckpt)
        # each rank reads its slices (resharded by dist_checkpointing), fp32 main params included
        dist_ckpt.load(tr, ckpt, step=int(meta["optimizer_step"]))
    else:
        weights = torch.load(ckpt / "model.pt", weights_only=True, map_location="cpu")
        hf_convert.hf_to_megatron(tr.chunks, tr.spec, weights)
        if mine is not None:
            adapter = torch.load(ckpt / "adapter.pt", weights_only=True, map_location="cpu")
            lora.load_adapter_tensors(tr.chunks, adapter)
        tr.optim.reload_main_params()
        _load_optimizer(tr, ckpt, int(meta["optimizer_step"]))
    rng_file = ckpt / f"rng_rank{tr.rank:05d}.pt"
    if meta["world_size"] == tr.world_size and rng_file.is_file():
        _restore_rng(torch.load(rng_file, weights_only=True))
    else:
        torch.manual_seed(tr.cfg.seed + int(meta["version"]))
    tr.version = int(meta["version"])
    tr.extra_state = dict(meta.get("extra_state") or {})
    tr.resumed_layout = saved
    return meta


def _check_dist_precision(meta: dict[str, Any], tr: TrainerState, ckpt: Path) -> None:
    """A torch_dist checkpoint holds the weights in the run's parameter dtype and fp32 main
    parameters only under bf16: loading it under the other precision is refused."""
    saved = bool((meta.get("optimizer") or {}).get("bf16"))
    if saved != tr.optim.bf16:
        flag = "--bf16" if saved else "no --bf16"
        raise CheckpointError(
            f"--load {ckpt} is a torch_dist checkpoint of a run with {flag}; resume with the "
            "same precision, or convert it first (python -m "
            "slime_async.tools.convert_checkpoint --load CKPT --out DIR), whose torch format "
            "loads under either"
        )


def _lr_schedule(tr: TrainerState) -> dict[str, object]:
    """The LR schedule is a pure function of the version and these fields (`optim.lr_at`)."""
    c = tr.cfg
    return {
        "lr": c.lr,
        "lr_warmup_init": c.lr_warmup_init,
        "min_lr": c.min_lr,
        "lr_warmup_steps": c.lr_warmup_steps,
        "lr_decay_steps": c.lr_decay_steps,
        "lr_decay_style": c.lr_decay_style,
    }


def _load_optimizer(tr: TrainerState, ckpt: Path, step: int) -> None:
    if step == 0:
        return
    moments = torch.load(ckpt / "optim.pt", weights_only=True, map_location="cpu")
    if getattr(tr, "lora", None) is not None:
        lora.load_optimizer_moments(tr.optim, tr.chunks, tr.lora, moments, step=step)
        return
    names = global_named_parameters(tr.chunks)
    shapes = {n: tuple(p.shape) for n, p in names.items()}
    shards = {k: hf_convert.hf_to_megatron_tensors(v, tr.spec, shapes) for k, v in moments.items()}
    tr.optim.load_state_tensors(shards, names, step=step)


def _restore_rng(rng: dict[str, object]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])
