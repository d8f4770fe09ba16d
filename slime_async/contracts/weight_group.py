"""The distributed weight transport's wire protocol, both ends: the process group the trainer's
sender (rank 0) and the engines (ranks `rank_offset + i`) join, how tensors are bucketed, and how
a bucket travels. One responsibility over 400 lines: the wire protocol both ends must agree on.

Owns `WeightGroup` (one member's handle on a weight-update group: a standalone gloo or NCCL
process group on its own TCP rendezvous, never the default `torch.distributed` group, so a
trainer rank can be in both), `plan_buckets` (the send order: tensors grouped by dtype, each
group split into buckets of at most `bucket_bytes`), `send_bucket` / `receive_bucket` (SGLang's two
load formats: one broadcast per tensor in `names` order, or `"flattened_bucket"`: one broadcast
of the bucket's tensors concatenated, all of one dtype, packed by `pack_bucket` into a
`bucket_buffer`) and `torch_dtype` (SGLang's dtype names).
Both ends must agree on all of it, which is why it is a contract. Imports nothing from the rest
of slime_async but the weights contract.

Aborting a group. A member that stops receiving (its bucket call failed or was refused before
the receive, or it hangs) would hold every broadcast until the op timeout. The group's own
TCPStore (hosted by rank 0) carries two keys for that: `sent`, the count of buckets rank 0
finished, and `abort`, the reason the group is given up. Every member's `broadcast` polls its op
and the `abort` key; once it is set the member raises `WeightGroupAborted` at once and hands the
process group (with its op still in flight) to a daemon thread that releases it, so no caller
ever blocks in a broadcast or in `close` on a member that stopped. `GroupControl` is the
driver's client on that store: it reads `sent` and sets `abort`.

Checksums. Before broadcasting its k-th bucket of a group (k counts from 0 per group), rank 0
puts the CRC-32 of the bucket's bytes, as sent (after the cast to the bucket's dtypes), in the
store under `crc32/<k>` (`send_bucket`); a member that received its k-th bucket compares
(`checksum_problem`) and refuses a bucket whose bytes differ, so a corrupted bucket is never
staged. SGLang members do not read the key; a sender that writes none is not checked.

Worked example (bucket_bytes = 1 MiB; fp32 tensors a: 0.6 MiB, b: 0.6 MiB, c: 0.2 MiB, a bf16
tensor d): buckets [a], [b, c], [d]; with the flattened format each bucket is one broadcast of
a flat buffer (a: 0.6 MiB; b ++ c: 0.8 MiB; d).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import mmap
import queue
import socket
import threading
import time
import zlib
from collections.abc import Mapping, Sequence

import torch

from slime_async.contracts.weights import TensorEntry, WeightManifest

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


ABORT_KEY = "abort"
"""Store key: set (to the reason) when the group is given up; every member's op stops."""
SENT_KEY = "sent"
"""Store key: how many buckets rank 0 finished sending (a counter, `store.add`)."""
CHECKSUM_KEY = "crc32/{}"
"""Store key of the CRC-32 of the group's k-th bucket (set by rank 0 before it sends it)."""
ABORT_POLL_S = 0.05
"""How often a member waiting on its op looks at the `abort` key (one store round trip)."""
_HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 and most arm64 kernels (`bucket_buffer`)."""
_CRC_THREAD_BYTES = 4 << 20
"""From this bucket size on, `pack_bucket` computes the CRC in a second thread."""


class WeightGroupAborted(RuntimeError):
    """The group was given up while this member waited on an op; form a new group."""


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


def local_address_towards(master_address: str) -> str:
    """This host's address on the route to `master_address` (no packet is sent): the interface
    a group member binds, so the group works across nodes and network namespaces."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_address, 9))
        return str(s.getsockname()[0])


class WeightGroup:
    """One member's handle on a weight-update process group.

    Example (rank 0 on the trainer, ranks 1..n on the engines, all at once)::

        g = WeightGroup.open(master_address="10.0.0.1", master_port=29600, rank=0,
                             world_size=3, group_name="weights", backend="gloo")
        send_bucket(g, tensors, bucket, flatten=True)     # engines: receive_bucket(g, ...)
        g.close()
    """

    def __init__(
        self,
        pg: object,
        *,
        rank: int,
        world_size: int,
        backend: str,
        device: str,
        store: object | None = None,
    ) -> None:
        self.pg, self.rank, self.world_size = pg, rank, world_size
        self.backend, self.device = backend, device
        self.store = store
        """The group's `PrefixStore` (rank 0 hosts it): the `abort` and `sent` keys."""
        self._work: object | None = None
        """The op in flight, if any (`close` must not wait for it)."""
        self._lock = threading.RLock()
        """Orders starting an op against leaving the group: `close` either sees the op in
        flight (and abandons) or shuts the group down before the op could start on it."""
        self._next_look = 0.0
        """When `_wait` next reads the `abort` key (at most every `ABORT_POLL_S`)."""
        self.buckets = 0
        """Buckets this member sent (rank 0) or received in this group: the next one's index."""

    @classmethod
    def open(
        cls,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = 300.0,
        rendezvous_timeout_s: float = 60.0,
    ) -> WeightGroup:
        """Join the group: blocks until all `world_size` members joined, failing after
        `min(rendezvous_timeout_s, timeout_s)` (a member that died before joining must not hold
        the others for the whole op timeout); each broadcast then fails after `timeout_s`."""
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of world_size {world_size}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs a CUDA device here; use backend 'gloo' on CPU")
        timeout = datetime.timedelta(seconds=timeout_s)
        join = datetime.timedelta(seconds=min(rendezvous_timeout_s, timeout_s))
        tcp = dist.TCPStore(
            master_address,
            int(master_port),
            world_size,
            is_master=rank == 0,
            timeout=join,
            wait_for_workers=False,
        )
        store = dist.PrefixStore(_prefix(group_name), tcp)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = join
            here = local_address_towards(master_address)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=here)]
            pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
            pg._set_default_timeout(timeout)  # joined: from now on the op timeout
            tcp.set_timeout(timeout)
            device = "cpu"
        else:
            nopts = dist.ProcessGroupNCCL.Options()
            nopts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, nopts)
            device = f"cuda:{torch.cuda.current_device()}"
        return cls(
            pg, rank=rank, world_size=world_size, backend=backend, device=device, store=store
        )

    def broadcast(self, t: torch.Tensor) -> None:
        """Broadcast `t` from rank 0 (in place on the other ranks). Raises the op's error, or
        `WeightGroupAborted` soon after the group's `abort` key is set (the group is then
        left: see `abandon`)."""
        with self._lock:
            if self.pg is None:  # left by `close`/`abort`, maybe from another thread mid-send
                raise WeightGroupAborted("the weight update group is closed")
            # no local reference to the group: a failed broadcast's traceback must not keep
            # it alive, or `close` could not release its connections
            self._work = self.pg.broadcast(t, 0)  # type: ignore[attr-defined]
        try:
            self._wait()
        finally:
            self._work = None

    def _wait(self) -> None:
        """Wait for the op in flight (then raise its error, if any), looking at the `abort` key
        every `ABORT_POLL_S` meanwhile. Raises `WeightGroupAborted` once the group is aborted
        or left by another thread. gloo wakes this thread the moment the op ends (its future's
        callback), so many small broadcasts cost no polling delay; NCCL's future completes at
        enqueue, so there the op's CUDA event is polled."""
        work, done = self._work, threading.Event()
        if self.backend == "gloo":
            work.get_future().add_done_callback(lambda _: done.set())  # type: ignore[attr-defined]
        while not done.wait(ABORT_POLL_S if self.backend == "gloo" else 0.002):
            if work.is_completed():  # type: ignore[attr-defined]
                break
            if self.pg is None:  # another thread left the group (`close`, `abort`)
                raise WeightGroupAborted("the weight update group was left during a broadcast")
            if time.monotonic() >= self._next_look:
                self._next_look = time.monotonic() + ABORT_POLL_S
                why = self.abort_reason()
                if why is not None:
                    self.abandon()
                    raise WeightGroupAborted(f"the weight update group was aborted: {why}")
        work.wait()  # type: ignore[attr-defined]  # raises the op's error

    def abort_reason(self) -> str | None:
        """The `abort` key's value, None while the group is not aborted (or has no store)."""
        if self.store is None:
            return None
        try:
            if not self.store.check([ABORT_KEY]):  # type: ignore[attr-defined]
                return None
            return bytes(self.store.get(ABORT_KEY)).decode(errors="replace")  # type: ignore[attr-defined]
        except RuntimeError as e:  # rank 0's store is gone: the group is gone with it
            return f"the group's store is unreachable ({e})"

    def mark_sent(self) -> None:
        """Rank 0: one more bucket finished (`GroupControl.sent` reads the count)."""
        if self.store is not None:
            self.store.add(SENT_KEY, 1)  # type: ignore[attr-defined]

    def abort(self, reason: str) -> None:
        """Give the group up for every member (they stop at their next poll), then leave it."""
        if self.store is not None:
            with contextlib.suppress(RuntimeError):
                self.store.set(ABORT_KEY, reason)  # type: ignore[attr-defined]
        self.abandon()

    def abandon(self) -> None:
        """Leave the group without waiting for its op in flight: a daemon thread releases the
        process group once that op ends (it fails at the op timeout at the latest)."""
        with self._lock:
            pg, work, self.pg, self.store, self._work = self.pg, self._work, None, None, None
        if pg is not None:
            threading.Thread(
                target=_release,
                args=(pg, work, self.backend),
                daemon=True,
                name="weight-group-release",
            ).start()

    def close(self) -> None:
        """Leave the group. Releasing the process group closes its connections, so members
        blocked in a broadcast from this rank fail at once instead of at the timeout. With an
        op in flight (another thread is in `broadcast`) it abandons the group instead: it
        never blocks."""
        with self._lock:
            if self._work is not None:
                self.abandon()
                return
            pg, self.pg, self.store = self.pg, None, None
        _shutdown(pg)
        del pg
        gc.collect()


def _prefix(group_name: str) -> str:
    return f"weight_group/{group_name}"


def _shutdown(pg: object) -> None:
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is not None:
        with contextlib.suppress(RuntimeError):  # a broken group: nothing left to release
            shutdown()


def _release(pg: object, work: object | None, backend: str) -> None:
    """Daemon: release an abandoned group. gloo: wait out its op first (gloo's `abort()` does
    not end an op in flight; it fails at the op timeout at the latest). NCCL: `abort()` the
    communicator at once (its watchdog would otherwise end the process at the op timeout;
    untested here: one GPU cannot hold a two-rank NCCL group)."""
    if backend == "nccl":
        with contextlib.suppress(RuntimeError):
            pg.abort()  # type: ignore[attr-defined]
    elif work is not None:
        with contextlib.suppress(RuntimeError):
            work.wait()  # type: ignore[attr-defined]
    _shutdown(pg)
    del pg, work
    gc.collect()


class GroupControl:
    """The driver's client on a group's store (rank 0 hosts it at `master_address:port`).

    Example::

        ctl = GroupControl.connect(master_address="10.0.0.1", master_port=29600,
                                   group_name="weights")
        if ctl.sent() < 3:
            ctl.abort("engine 2 refused bucket 2 before receiving it")
    """

    def __init__(self, store: object) -> None:
        self.store = store

    @classmethod
    def connect(
        cls, *, master_address: str, master_port: int, group_name: str, timeout_s: float = 10.0
    ) -> GroupControl:
        """Connect to the store of the group formed at `master_address:master_port` (blocks up
        to `timeout_s`; raises RuntimeError/OSError if rank 0 does not answer)."""
        import torch.distributed as dist

        tcp = dist.TCPStore(
            master_address,
            int(master_port),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        return cls(dist.PrefixStore(_prefix(group_name), tcp))

    def sent(self) -> int:
        """How many buckets rank 0 finished sending."""
        return int(self.store.add(SENT_KEY, 0))  # type: ignore[attr-defined]

    def abort(self, reason: str) -> None:
        """Give the group up: every member's op stops waiting and raises `WeightGroupAborted`."""
        self.store.set(ABORT_KEY, reason)  # type: ignore[attr-defined]


def tensors_crc32(ts: Sequence[torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes, one after another (a flat bucket and its pieces agree)."""
    crc = 0
    for t in ts:
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            crc = zlib.crc32(flat.cpu().view(torch.uint8).numpy(), crc)
    return crc


def publish_checksum(g: WeightGroup, crc: int) -> None:
    """Rank 0: the checksum of the bucket it sends next (index `g.buckets`)."""
    if g.store is not None:
        g.store.set(CHECKSUM_KEY.format(g.buckets), str(crc))  # type: ignore[attr-defined]


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


def pack_bucket(
    tensors: Mapping[str, torch.Tensor], bucket: Sequence[TensorEntry], device: str
) -> tuple[torch.Tensor, int]:
    """The flattened format's payload and its CRC-32: the bucket's tensors, each cast to its
    entry's dtype, one after another in `bucket` order, as one flat tensor on `device`.

    Each tensor is read once and written once, straight into a fresh `bucket_buffer` (the cast
    is that copy); a bucket of one tensor already contiguous in its dtype on `device` is sent
    as it is. On the CPU a second thread computes the CRC of each tensor's bytes as soon as
    they are written (torch's copy and zlib both release the GIL), so the two passes overlap.
    Raises ValueError for a bucket of several dtypes or a tensor whose shape is not its
    entry's."""
    dtypes = {e.dtype for e in bucket}
    if len(dtypes) != 1:
        raise ValueError(f"a {FLATTENED} bucket holds one dtype, got {sorted(dtypes)}")
    dt = torch_dtype(bucket[0].dtype)
    for e in bucket:
        if tuple(tensors[e.name].shape) != tuple(e.shape):
            raise ValueError(
                f"tensor {e.name!r} has shape {tuple(tensors[e.name].shape)}, its manifest "
                f"entry {tuple(e.shape)}: the weights changed shape since the manifest was made"
            )
    if len(bucket) == 1:
        t = tensors[bucket[0].name].detach()
        if t.dtype == dt and t.device == torch.device(device) and t.is_contiguous():
            return t.reshape(-1), tensors_crc32([t])
    nbytes = sum(entry_nbytes(e) for e in bucket)
    flat = bucket_buffer(nbytes, device).view(dt)
    pieces, at = [], 0
    for e in bucket:
        t = tensors[e.name].detach()
        pieces.append((flat[at : at + t.numel()].view(t.shape), t))
        at += t.numel()
    if flat.device.type != "cpu" or nbytes < _CRC_THREAD_BYTES:
        for dst, src in pieces:
            dst.copy_(src)
        return flat, tensors_crc32([flat])
    return flat, _copy_and_crc(pieces)


def _copy_and_crc(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Copy each `(dst, src)` in order here while a second thread keeps the running CRC-32 of
    the `dst`s already written; returns the CRC of all of them, one after another."""
    written: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()
    crc, failed = [0], []

    def follow() -> None:
        while (t := written.get()) is not None:
            try:
                crc[0] = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc[0])
            except BaseException as e:  # re-raised by the packing thread
                failed.append(e)

    worker = threading.Thread(target=follow, daemon=True, name="bucket-crc32")
    worker.start()
    try:
        for dst, src in pieces:
            dst.copy_(src)
            written.put(dst)
    finally:
        written.put(None)
        worker.join()
    if failed:
        raise failed[0]
    return crc[0]


def send_bucket(
    g: WeightGroup,
    tensors: Mapping[str, torch.Tensor],
    bucket: Sequence[TensorEntry],
    *,
    flatten: bool,
) -> None:
    """Rank 0: publish the bucket's checksum, then broadcast its tensors (cast to the bucket's
    dtypes): one flat broadcast (`pack_bucket`), or one per tensor in `bucket` order."""
    if flatten:
        flat, crc = pack_bucket(tensors, bucket, g.device)
        publish_checksum(g, crc)
        g.broadcast(flat)
    else:
        ts = [tensors[e.name].detach().to(g.device, torch_dtype(e.dtype)) for e in bucket]
        publish_checksum(g, tensors_crc32(ts))
        for t in ts:
            g.broadcast(t.contiguous())
    g.buckets += 1


def send_buckets(
    g: WeightGroup,
    tensors: Mapping[str, torch.Tensor],
    buckets: Sequence[Sequence[TensorEntry]],
    *,
    flatten: bool,
) -> None:
    """Rank 0: send every bucket in order, counting each one finished in the `sent` key. On any
    failure (a member died, the group was aborted) the group is aborted and left, so the other
    members' receives stop now rather than at the timeout; then it raises.

    The tensors handed to the process group may be views of `tensors`: an op abandoned in
    flight only reads them (a member that stopped receiving gets nothing usable)."""
    try:
        for b in buckets:
            send_bucket(g, tensors, b, flatten=flatten)
            g.mark_sent()
    except BaseException as e:
        g.abort(f"rank 0 stopped sending: {type(e).__name__}: {e}")
        raise


def receive_bucket(
    g: WeightGroup, bucket: Sequence[TensorEntry], *, flatten: bool
) -> dict[str, torch.Tensor]:
    """Ranks > 0: receive the bucket `send_bucket` sends; returns name -> tensor."""
    if flatten:
        dtypes = {e.dtype for e in bucket}
        if len(dtypes) != 1:
            raise ValueError(f"a {FLATTENED} bucket holds one dtype, got {sorted(dtypes)}")
        nbytes = sum(entry_nbytes(e) for e in bucket)
        flat = bucket_buffer(nbytes, g.device).view(torch_dtype(bucket[0].dtype))
        g.broadcast(flat)
        out, at = {}, 0
        for e in bucket:
            n = entry_nbytes(e) // flat.itemsize
            out[e.name] = flat[at : at + n].view(e.shape)
            at += n
        g.buckets += 1
        return out
    out = {}
    for e in bucket:
        t = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device=g.device)
        g.broadcast(t)
        out[e.name] = t
    g.buckets += 1
    return out


def checksum_problem(
    g: WeightGroup, bucket: Sequence[TensorEntry], got: Mapping[str, torch.Tensor]
) -> str | None:
    """After `receive_bucket`: why the bucket's bytes are not what rank 0 sent (a sentence), or
    None when they match or rank 0 published no checksum (a sender that does not write one)."""
    key = CHECKSUM_KEY.format(g.buckets - 1)
    store = g.store
    try:
        if store is None or not store.check([key]):  # type: ignore[attr-defined]
            return None
        want = int(bytes(store.get(key)).decode())  # type: ignore[attr-defined]
    except (RuntimeError, ValueError):
        return None  # rank 0's store is gone: the receive itself would have failed
    have = tensors_crc32([got[e.name] for e in bucket])
    if have == want:
        return None
    return f"bucket {g.buckets - 1} arrived corrupted (CRC-32 {have:08x}, rank 0 sent {want:08x})"


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
