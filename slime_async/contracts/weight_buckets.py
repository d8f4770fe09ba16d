"""How weights are laid out for a weight update, independent of how they travel: the bucket plan
both ends of a group agree on, the bytes of a flat bucket, and their digests.

Owns `plan_buckets` (the send order: tensors grouped by dtype, each group split into buckets of
at most `bucket_bytes`), `pack_bucket` (the `"flattened_bucket"` payload: a bucket's tensors,
cast to its dtype, back to back in one `bucket_buffer`, with its xxh3 digests computed while it
is written: `copy_and_checksum`), `split_flat` (the receiving end's views of such a buffer),
`tensors_checksum` (one digest per `weight_shm.CHUNK_BYTES` of the bytes), `torch_dtype`
(SGLang's dtype names), `bucket_body` / `entries_from_body` (a bucket as the fields of an update
call, and those fields validated back into entries) and `nonfinite_names`. Pure functions of
tensors and manifests: nothing here talks to another process (`weight_group` forms the group,
`weight_transfer` moves buckets through it).

Worked example (bucket_bytes = 1 MiB; fp32 tensors a: 0.6 MiB, b: 0.6 MiB, c: 0.2 MiB, a bf16
tensor d): buckets [a], [b, c], [d]; with the flattened format each bucket is one flat buffer
(a: 0.6 MiB; b ++ c: 0.8 MiB; d).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import queue
import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from slime_async.contracts import weight_shm as shm
from slime_async.contracts.weights import TensorEntry, WeightManifest, all_finite

FLATTENED = "flattened_bucket"
"""SGLang's `load_format` for one flat broadcast per bucket."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

_HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 and most arm64 kernels (`bucket_buffer`)."""
_CHECKSUM_THREAD_BYTES = 4 << 20
"""From this bucket size on, `pack_bucket` computes the checksum in a second thread."""


def torch_dtype(name: str) -> torch.dtype:
    """SGLang's dtype spelling ("bfloat16", also "torch.bfloat16") -> torch dtype."""
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def entry_nbytes(e: TensorEntry) -> int:
    n = 1
    for d in e.shape:
        n *= d
    return n * torch_dtype(e.dtype).itemsize


def plan_buckets(manifest: WeightManifest, bucket_bytes: int) -> list[tuple[TensorEntry, ...]]:
    """The send order: per dtype (in order of first appearance), consecutive tensors packed into
    buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    by_dtype: dict[str, list[TensorEntry]] = {}
    for e in manifest.entries:
        by_dtype.setdefault(e.dtype, []).append(e)
    out: list[tuple[TensorEntry, ...]] = []
    for entries in by_dtype.values():
        cur: list[TensorEntry] = []
        size = 0
        for e in entries:
            n = entry_nbytes(e)
            if cur and size + n > bucket_bytes:
                out.append(tuple(cur))
                cur, size = [], 0
            cur.append(e)
            size += n
        if cur:
            out.append(tuple(cur))
    return out


FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def in_dtype(manifest: WeightManifest, dtype: str | None) -> WeightManifest:
    """`manifest` with every floating-point tensor sent as `dtype` (None: unchanged);
    `send_bucket` casts on the sender."""
    if dtype is None:
        return manifest
    torch_dtype(dtype)
    entries = tuple(
        dataclasses.replace(e, dtype=dtype) if e.dtype in FLOAT_DTYPES else e
        for e in manifest.entries
    )
    return dataclasses.replace(manifest, entries=entries)


def bucket_body(
    bucket: Sequence[TensorEntry], *, group_name: str, flatten: bool
) -> dict[str, object]:
    """The `/update_weights_from_distributed` fields describing `bucket`."""
    return {
        "names": [e.name for e in bucket],
        "dtypes": [e.dtype for e in bucket],
        "shapes": [list(e.shape) for e in bucket],
        "group_name": group_name,
        "load_format": FLATTENED if flatten else None,
    }


def tensors_checksum(ts: Sequence[torch.Tensor]) -> list[int]:
    """The digests of the tensors' bytes, one after another (`weight_shm.ChunkHasher`: a flat
    bucket and its pieces agree)."""
    h = shm.ChunkHasher()
    for t in ts:
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            h.update(memoryview(flat.cpu().view(torch.uint8).numpy()))
    return h.finish()


def bucket_buffer(nbytes: int, device: str = "cpu") -> torch.Tensor:
    """A fresh uint8 buffer of `nbytes` for one flat bucket (the sender packs into it, a member
    receives into it), freed with its last view.

    On a Linux CPU a large one is anonymous memory advised to be backed by transparent huge
    pages (`madvise(MADV_HUGEPAGE)`, effective where THP is `madvise` or `always`) and aligned
    to them: a bucket is written once end to end, and faulting it in 4 KiB pages costs several
    times the writing (docs/results/2026-11-27-weight-sync-floor.md). Elsewhere, or where that
    fails, `torch.empty`."""
    if device != "cpu" or nbytes < 2 * _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        m = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    with contextlib.suppress(OSError):  # no THP here: plain pages, as torch.empty would get
        m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # holds `m` until its last view is freed
    pad = -whole.data_ptr() % _HUGE_PAGE
    return whole[pad : pad + nbytes]


def bucket_dtype(bucket: Sequence[TensorEntry]) -> torch.dtype:
    dtypes = {e.dtype for e in bucket}
    if len(dtypes) != 1:
        raise ValueError(f"a {FLATTENED} bucket holds one dtype, got {sorted(dtypes)}")
    return torch_dtype(bucket[0].dtype)


def bucket_pieces(
    tensors: Mapping[str, torch.Tensor], bucket: Sequence[TensorEntry], flat: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view of `flat`, source tensor) per entry, in order; ValueError for a
    tensor whose shape is not its entry's."""
    pieces, at = [], 0
    for e in bucket:
        t = tensors[e.name].detach()
        if tuple(t.shape) != tuple(e.shape):
            raise ValueError(
                f"tensor {e.name!r} has shape {tuple(t.shape)}, its manifest entry "
                f"{tuple(e.shape)}: the weights changed shape since the manifest was made"
            )
        pieces.append((flat[at : at + t.numel()].view(t.shape), t))
        at += t.numel()
    return pieces


def pack_bucket(
    tensors: Mapping[str, torch.Tensor], bucket: Sequence[TensorEntry], device: str
) -> tuple[torch.Tensor, list[int]]:
    """The flattened format's payload and its digests: the bucket's tensors, each cast to its
    entry's dtype, one after another in `bucket` order, as one flat tensor on `device`.

    Each tensor is read once and written once, straight into a fresh `bucket_buffer` (the cast
    is that copy); a bucket of one tensor already contiguous in its dtype on `device` is sent
    as it is. On the CPU a second thread computes the digests of the bytes as soon as they are
    written (torch's copy and xxhash both release the GIL), so the two passes overlap.
    Raises ValueError for a bucket of several dtypes or a tensor whose shape is not its
    entry's."""
    dt = bucket_dtype(bucket)
    if len(bucket) == 1:
        t = tensors[bucket[0].name].detach()
        if tuple(t.shape) != tuple(bucket[0].shape):
            bucket_pieces(tensors, bucket, torch.empty(t.numel(), dtype=dt))  # raises, naming it
        if t.dtype == dt and t.device == torch.device(device) and t.is_contiguous():
            return t.reshape(-1), tensors_checksum([t])
    nbytes = sum(entry_nbytes(e) for e in bucket)
    raw = bucket_buffer(nbytes, device)
    flat = raw.view(dt)
    pieces = bucket_pieces(tensors, bucket, flat)
    if flat.device.type != "cpu" or nbytes < _CHECKSUM_THREAD_BYTES:
        for dst, src in pieces:
            dst.copy_(src)
        return flat, tensors_checksum([flat])
    return flat, copy_and_checksum(raw, pieces)


def copy_and_checksum(
    raw: torch.Tensor,
    pieces: Sequence[tuple[torch.Tensor, torch.Tensor]],
    on_chunk: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Copy each `(dst, src)` in order (each `dst` a view of the uint8 buffer `raw`, back to
    back from its start) here, while a second thread computes the digest of every chunk of
    `raw` as soon as it is written (`on_chunk(c, digest)` then); returns all the digests."""
    written: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    digests: list[int] = []
    failed: list[BaseException] = []
    size, base = raw.numel(), raw.data_ptr()

    def follow() -> None:
        done = 0  # bytes hashed so far
        while True:
            upto = written.get()
            end = size if upto is None else upto - upto % shm.CHUNK_BYTES
            try:
                while done < end:
                    stop = min(done + shm.CHUNK_BYTES, size)
                    d = shm.chunk_digest(raw[done:stop])
                    digests.append(d)
                    if on_chunk is not None:
                        on_chunk(len(digests) - 1, d)
                    done = stop
            except BaseException as e:  # re-raised by the packing thread
                failed.append(e)
                return
            if upto is None:
                return

    worker = threading.Thread(target=follow, daemon=True, name="bucket-checksum")
    worker.start()
    try:
        for dst, src in pieces:
            dst.copy_(src)
            written.put(dst.data_ptr() + dst.numel() * dst.element_size() - base)
    finally:
        written.put(None)
        worker.join()
    if failed:
        raise failed[0]
    return digests


def split_flat(flat: torch.Tensor, bucket: Sequence[TensorEntry]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for e in bucket:
        n = entry_nbytes(e) // flat.itemsize
        out[e.name] = flat[at : at + n].view(e.shape)
        at += n
    return out


def nonfinite_names(got: Mapping[str, torch.Tensor]) -> list[str]:
    """The tensors holding NaN or inf, one sentence each (never served, whichever transport
    brought them)."""
    return [
        f"tensor {k!r} holds non-finite values (NaN or inf)"
        for k, t in got.items()
        if not all_finite(t)
    ]


def entries_from_body(names: object, dtypes: object, shapes: object) -> tuple[TensorEntry, ...]:
    """Validate the `names`/`dtypes`/`shapes` fields of an update call (ValueError names the
    problem) and return them as entries."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must be "
            "non-empty lists of the same length, one entry per tensor"
        )
    out = []
    for n, d, s in zip(names, dtypes, shapes, strict=True):
        if not isinstance(n, str) or not isinstance(d, str):
            raise ValueError(f"tensor name and dtype must be strings, got {n!r}, {d!r}")
        if not isinstance(s, list) or not all(isinstance(x, int) and x >= 0 for x in s):
            raise ValueError(f"shape of {n!r} must be a list of non-negative ints, got {s!r}")
        torch_dtype(d)
        out.append(TensorEntry(name=n, dtype=d.removeprefix("torch."), shape=tuple(s)))
    return tuple(out)
