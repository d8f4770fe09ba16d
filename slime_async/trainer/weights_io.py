"""HF-format weight directories on disk: atomic write (export) and read (import).

Owns: the on-disk contract between trainer and engines — a directory with HF `config.json`
plus `model.safetensors` holding the tensor names `transformers` writes with `save_pretrained`
(sharded as `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` above
`max_shard_size`, by huggingface_hub's shard splitter, as `save_pretrained` does), written to a
temp dir and renamed into place. The weight version is recorded in the safetensors metadata
(`weight_version`). Files are written tensor by tensor (`write_tensor_file`): the tensors may
be views of live parameters, each is cast (and, with a `transform`, e.g. a LoRA adapter folded
in) on its own as it is written, so no copy of the whole model is ever held. Must never import
the controller, engine, rollout or data-worker parts of `slime_async`.

The source's identity: given the HF directory the run started from (`source`: --hf-checkpoint
or its GGUF conversion), an export keeps everything of it that `ModelSpec` does not model:
its `config.json` with only the architecture fields (`ARCH_FIELDS`) overwritten, so BOS/EOS/PAD
ids, RoPE settings and any other field survive; `generation_config.json`; and the tokenizer and
chat-template files (`IDENTITY_FILES`). Without a source (the embedded tiny MoE) the config is
`ModelSpec.to_hf_config()`'s, as before.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from slime_async.contracts.model import ModelSpec
from slime_async.contracts.weights import HFWeights

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_SIZE = "5GB"
"""Largest safetensors file an export writes (huggingface_hub's default); above it, shards."""

ARCH_FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "initializer_range",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "attention_bias",
    "mlp_bias",
    "dtype",
    "text_config",
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)
"""`config.json` fields an export owns (the `ModelSpec` and the tensors written); every other
field of the source's config is kept."""
_DROPPED_FIELDS = ("torch_dtype", "quantization_config", "_name_or_path", "transformers_version")
"""Source config fields that no longer describe the export (its dtype is `dtype`)."""

IDENTITY_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
"""Files copied unchanged from the source into every export (those it has)."""


def _hf_config_dict(spec: ModelSpec) -> dict[str, object]:
    cfg = spec.to_hf_config()
    cfg.architectures = [spec.hf_architecture]
    d = cfg.to_dict()
    d["dtype"] = "float32"
    return d


def export_config(spec: ModelSpec, source: str | Path | None) -> dict[str, object]:
    """The export's `config.json`: `spec`'s, or the source's with `ARCH_FIELDS` replaced.

    Raises ValueError when the merged config does not describe `spec` (a source of another
    model, e.g. RoPE settings that disagree).
    """
    ours = _hf_config_dict(spec)
    if source is None:
        return ours
    src_cfg = Path(source) / "config.json"
    if not src_cfg.is_file():
        raise FileNotFoundError(
            f"export source {source} has no config.json; give the HF directory the run "
            "started from (--hf-checkpoint)"
        )
    merged = {k: v for k, v in json.loads(src_cfg.read_text()).items() if k not in _DROPPED_FIELDS}
    for k in ARCH_FIELDS:
        if k in ours:
            merged[k] = ours[k]
        else:
            merged.pop(k, None)
    try:
        back = ModelSpec.from_hf_config(merged)
    except (KeyError, ValueError) as e:
        raise ValueError(f"config.json of export source {source} is unusable: {e}") from None
    if back != spec:
        raise ValueError(
            f"config.json of export source {source} describes another model than the one "
            f"exported ({back} vs {spec}); export with the source the run started from"
        )
    return merged


def copy_identity(source: str | Path | None, dst: Path) -> list[str]:
    """Copy the source's `IDENTITY_FILES` into `dst`; returns the names copied."""
    if source is None:
        return []
    copied = []
    for name in IDENTITY_FILES:
        f = Path(source) / name
        if f.is_file():
            shutil.copyfile(f, dst / name)
            copied.append(name)
    return copied


def atomic_replace_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written `tmp` directory onto `final` (replacing an old one)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


Transform = Callable[[str, torch.Tensor], torch.Tensor]
"""`(name, tensor) -> tensor` of the same shape, applied to one tensor just before it is written
(e.g. `trainer.lora.merger`: the adapter folded into its base weight)."""


def write_hf_dir(
    weights: HFWeights,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    source: str | Path | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    finish: Callable[[Path], object] | None = None,
    transform: Transform | None = None,
) -> Path:
    """Write `weights` as an HF checkpoint directory at `path`, atomically; returns the path.

    `dtype` (default: keep each tensor's) casts floating tensors, e.g. torch.bfloat16 to halve
    the size. `source`: the HF directory whose identity the export carries (see the module
    docstring). `finish` is called on the complete temporary directory just before it is
    renamed into place (a marker file written last). `transform`: applied to each tensor as it
    is written. Tensor by tensor: `weights.tensors` may be views of live parameters (read
    before this returns).
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        cfg = export_config(weights.spec, source)
        if dtype is not None:
            cfg["dtype"] = str(dtype).removeprefix("torch.")
        meta = {"format": "pt", "weight_version": str(weights.version)}
        _save_safetensors(weights.tensors, tmp, meta, max_shard_size, dtype, transform)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        copy_identity(source, tmp)
        if finish is not None:
            finish(tmp)
        atomic_replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _save_safetensors(
    tensors: dict[str, torch.Tensor],
    d: Path,
    meta: dict[str, str],
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    transform: Transform | None,
) -> None:
    """One `model.safetensors`, or shards plus `model.safetensors.index.json` (as
    `save_pretrained` names and splits them, sized in the written dtype) when the tensors
    exceed `max_shard_size`."""
    from huggingface_hub import constants, split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        dict(sorted(tensors.items())),
        get_storage_size=lambda t: _written_bytes(t, dtype),
        get_storage_id=lambda t: None,  # views of one parameter (gate/up) are written apart
        filename_pattern=constants.SAFETENSORS_WEIGHTS_FILE_PATTERN,
        max_shard_size=max_shard_size,
    )
    if not split.filename_to_tensors:  # no tensors: still one (empty) file, as before
        write_tensor_file({}, d / WEIGHTS_FILE, metadata=meta)
    for fname, names in split.filename_to_tensors.items():
        shard = {n: tensors[n] for n in names}
        write_tensor_file(shard, d / fname, dtype=dtype, metadata=meta, transform=transform)
    if split.is_sharded:
        index = {"metadata": {**split.metadata, **meta}, "weight_map": split.tensor_to_filename}
        (d / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


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


# --------------------------------------------------------------------------- one-file hand-off
SHM_DIR = Path("/dev/shm")
"""Where a version handed to a process on the same node is written (`write_tensor_file`): a
memory file system, so the file's pages are the receiver's too once it maps them."""
_ST_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _written_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `t` is written in: `dtype` for a floating tensor when given, else its own."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _written_bytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * torch.empty((), dtype=_written_dtype(t, dtype)).element_size()


WRITE_BLOCK = 1 << 22
"""Elements of a tensor cast and written at once (`write_tensor_file`): an fp32 export of a
bf16 embedding never holds the whole fp32 copy (16 MiB at a time)."""

PARAMS_LAYOUT = "megatron-params"
"""`write_tensor_file` metadata `layout` of a file holding a model's own parameters under their
names (`MegatronTrainer.write_weights_file` where rank 0 holds the whole model), rather than
the HF export: a model of the same spec and layout serves its tensors as they are."""


def write_tensor_file(
    tensors: dict[str, torch.Tensor],
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
    transform: Transform | None = None,
) -> int:
    """Write `tensors` as one safetensors file at `path`, tensor by tensor (each through
    `transform`, then cast to `dtype` when floating and made contiguous, on its own: no copy
    of the whole model is ever held), atomically (a temporary name, then renamed); returns the
    file's bytes. `tensors` may be views of live parameters: they are read here, before this
    returns. ValueError when `transform` changes a tensor's shape (the header is written
    first, from the tensors as given)."""
    items = sorted(tensors.items())
    out_dtype = {k: _written_dtype(t, dtype) for k, t in items}
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    at = 0
    for k, t in items:
        size = _written_bytes(t, dtype)
        header[k] = {"dtype": _ST_DTYPES[out_dtype[k]], "shape": list(t.shape),
                     "data_offsets": [at, at + size]}  # fmt: skip
        at += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for k, t in items:
                c = t if transform is None else transform(k, t)
                if c.shape != t.shape:
                    raise ValueError(
                        f"the transform turned {k!r} from {tuple(t.shape)} into "
                        f"{tuple(c.shape)}: it must keep each tensor's shape"
                    )
                flat = c.detach().to("cpu").contiguous().view(-1)  # its own dtype: no cast yet
                for i in range(0, flat.numel(), WRITE_BLOCK):  # cast a block at a time
                    block = flat[i : i + WRITE_BLOCK].to(out_dtype[k])
                    f.write(memoryview(block.view(torch.uint8).numpy()))
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return 8 + len(raw) + at


def map_tensor_file(
    path: str | Path, *, unlink: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a safetensors file (`write_tensor_file`'s, or any) and its metadata,
    as views of the file's pages (mapped copy-on-write: nothing is read or copied until a
    tensor is, and the pages stay mapped while any tensor lives). `unlink`: remove the file
    once mapped (its pages go when the last tensor does)."""
    import mmap

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else b""
    if unlink:
        Path(path).unlink()
    n = int.from_bytes(bytes(mm[:8]), "little")
    header = json.loads(bytes(mm[8 : 8 + n]))
    meta = header.pop("__metadata__", None) or {}
    tensors = {}
    for k, e in header.items():
        begin, end = e["data_offsets"]
        dt = _ST_NAMES[e["dtype"]]
        if end == begin:
            tensors[k] = torch.empty(e["shape"], dtype=dt)
            continue
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=8 + n + begin)
        tensors[k] = flat.view(dt).view(e["shape"])
    return tensors, meta
