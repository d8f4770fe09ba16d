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
puts the xxh3_64 digests of the bucket's bytes as sent (after the cast to the bucket's dtypes),
one per `weight_shm.CHUNK_BYTES`, in the store under `xxh3/<k>` (`send_bucket`); a member that
received its k-th bucket compares (`checksum_problem`) and refuses a bucket whose bytes differ,
so a corrupted bucket is never staged. SGLang members do not read the key; a sender that writes
none is not checked.

Same node. On gloo, when the group forms, rank 0 offers shared memory (`shm/offer`: its
`weight_shm.host_identity`, pid, a probe segment, the group's nonce) and every member answers
`shm/member/<rank>`: `shm` when it is on the same node (same identity, the probe segment
readable, not turned off on either side), else `wire`. Only rank 0 and the `wire` members form
the gloo process group (ranks renumbered in the order of their group ranks). Rank 0 packs each
bucket straight into a segment of its `SegmentPool` and, per bucket k, puts the segment's
descriptor in `shm/bucket/<k>` before packing and each chunk's digest in `xxh3/<k>/<c>` as soon
as the chunk is written; a `shm` member maps the segment read-only (`SegmentReader`), and checks
chunk c (digest, finite values) while rank 0 writes the next ones. The wire members get the same
bytes broadcast from the segment. Segments come in sets, one segment per bucket of a version;
a member that serves tensors viewing a set says so in `shm/holds/<rank>` after its swap, and
rank 0 writes each version into a set no member holds (two sets alternate), so the bytes a
member serves are never written while it serves them. Every failure re-forms the group, and a
new group never writes an old group's segments.

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
from collections.abc import Callable, Collection, Mapping, Sequence

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


ABORT_KEY = "abort"
"""Store key: set (to the reason) when the group is given up; every member's op stops."""
SENT_KEY = "sent"
"""Store key: how many buckets rank 0 finished sending (a counter, `store.add`)."""
CHECKSUM_KEY = "xxh3/{}"
"""Store key of the digests of the group's k-th bucket (set by rank 0 before it sends it)."""
CHUNK_KEY = "xxh3/{}/{}"
"""Store key of chunk c's digest of bucket k (same-node path: set as soon as c is written)."""
SHM_OFFER_KEY = "shm/offer"
"""Store key: rank 0's `weight_shm.Offer` (empty: no offer)."""
SHM_MEMBER_KEY = "shm/member/{}"
"""Store key: member r's answer to the offer, `shm` or `wire`."""
SHM_BUCKET_KEY = "shm/bucket/{}"
"""Store key: bucket k's segment, `<set>,<bucket of the version>,<rank 0's fd>,<bytes>`."""
SHM_HOLDS_KEY = "shm/holds/{}"
"""Store key: the sets member r serves tensors from, comma-separated (empty: none)."""
ABORT_POLL_S = 0.05
"""How often a member waiting on its op looks at the `abort` key (one store round trip)."""
_HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 and most arm64 kernels (`bucket_buffer`)."""
_CHECKSUM_THREAD_BYTES = 4 << 20
"""From this bucket size on, `pack_bucket` computes the checksum in a second thread."""
_SHM_SETS = 3
"""Most segment sets rank 0 keeps (two alternate; a third only if members hold both)."""


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


@dataclasses.dataclass(slots=True)
class SameNode:
    """One member's side of the same-node path, settled when the group forms."""

    ranks: frozenset[int] = frozenset()
    """The members that take buckets through shared memory (known to rank 0 and to the wire
    members; a same-node member knows itself)."""
    pool: shm.SegmentPool | None = None
    """Rank 0: its segments (None when no member takes them)."""
    reader: shm.SegmentReader | None = None
    """A member on the same node: its mappings of rank 0's segments."""
    why: str = ""
    """A member: why its buckets take the wire (empty when they do not)."""

    def close(self) -> None:
        pool, reader, self.pool, self.reader = self.pool, self.reader, None, None
        if pool is not None:
            pool.close()
        if reader is not None:
            reader.close()


def _meet_same_node(
    store: object,
    rank: int,
    world_size: int,
    *,
    allowed: bool,
    host_id: str | None,
    join: datetime.timedelta,
) -> SameNode:
    """The group's same-node handshake through its store (before any process group forms):
    rank 0 offers, every member answers `shm` or `wire`; rank 0 and the wire members learn
    every answer. Blocks up to `join` for the others (as the rendezvous does)."""
    keys = [SHM_MEMBER_KEY.format(r) for r in range(1, world_size)]
    if rank == 0:
        pool = None
        if allowed and shm.supported():
            with contextlib.suppress(OSError):
                pool = shm.SegmentPool()
        offer = "" if pool is None else pool.offer(host_id or shm.host_identity()).to_json()
        store.set(SHM_OFFER_KEY, offer)  # type: ignore[attr-defined]
    else:
        store.wait([SHM_OFFER_KEY], join)  # type: ignore[attr-defined]
        raw = bytes(store.get(SHM_OFFER_KEY)).decode()  # type: ignore[attr-defined]
        reader, why = _accept(shm.Offer.from_json(raw), allowed, host_id)
        store.set(SHM_MEMBER_KEY.format(rank), "wire" if reader is None else "shm")  # type: ignore[attr-defined]
        if reader is not None:
            return SameNode(ranks=frozenset({rank}), reader=reader)
    if keys:
        store.wait(keys, join)  # type: ignore[attr-defined]
    ranks = frozenset(
        r
        for r, k in enumerate(keys, 1)
        if bytes(store.get(k)) == b"shm"  # type: ignore[attr-defined]
    )
    if rank == 0:
        if not ranks and pool is not None:
            pool.close()
            pool = None
        return SameNode(ranks=ranks, pool=pool)
    return SameNode(ranks=ranks, why=why)


def _accept(
    offer: shm.Offer | None, allowed: bool, host_id: str | None
) -> tuple[shm.SegmentReader | None, str]:
    """A member's answer to rank 0's offer: a reader of its segments, or why not."""
    if offer is None:
        return None, "rank 0 offers no shared memory (off, or not on Linux)"
    if not allowed:
        return None, "the same-node path is turned off on this engine"
    here = host_id or shm.host_identity()
    if offer.host != here:
        return None, f"rank 0 is on another node ({offer.host} here {here})"
    reader = shm.SegmentReader(offer)
    why = reader.probe()
    return (None, why) if why is not None else (reader, "")


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
        same_node: SameNode | None = None,
    ) -> None:
        self.pg, self.rank, self.world_size = pg, rank, world_size
        """`pg`: the process group of rank 0 and the wire members; None for a member on the
        same node (it never broadcasts) and for a rank 0 whose members all are."""
        self.backend, self.device = backend, device
        self.store = store
        """The group's `PrefixStore` (rank 0 hosts it): the `abort` and `sent` keys."""
        self.same_node = same_node or SameNode()
        """Who takes buckets through shared memory (`SameNode`)."""
        self.left = False
        """True once `close`/`abandon` left the group (from any thread)."""
        self.timeout_s = 300.0
        """The op timeout (a same-node member's wait for rank 0's bytes too)."""
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
        same_node: bool = False,
        host_id: str | None = None,
    ) -> WeightGroup:
        """Join the group: blocks until all `world_size` members joined, failing after
        `min(rendezvous_timeout_s, timeout_s)` (a member that died before joining must not hold
        the others for the whole op timeout); each broadcast then fails after `timeout_s`.

        `same_node` (gloo): offer (rank 0) or accept (a member) buckets through shared memory
        between processes on one node ("Same node" above); both sides must allow it. `host_id`:
        this process's `weight_shm.host_identity` as the offer carries it (rank 0; tests name
        another node with it)."""
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
            same = _meet_same_node(
                store, rank, world_size, allowed=same_node, host_id=host_id, join=join
            )
            wire = [r for r in range(world_size) if r not in same.ranks]
            pg = None
            if rank in wire and len(wire) > 1:  # the members on the same node never join it
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = join
                here = local_address_towards(master_address)
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=here)]
                on = store if len(wire) == world_size else dist.PrefixStore("wire", store)
                pg = dist.ProcessGroupGloo(on, wire.index(rank), len(wire), opts)
                pg._set_default_timeout(timeout)  # joined: from now on the op timeout
            tcp.set_timeout(timeout)
            device = "cpu"
        else:
            same = SameNode()
            nopts = dist.ProcessGroupNCCL.Options()
            nopts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, nopts)
            device = f"cuda:{torch.cuda.current_device()}"
        g = cls(
            pg,
            rank=rank,
            world_size=world_size,
            backend=backend,
            device=device,
            store=store,
            same_node=same,
        )
        g.timeout_s = timeout_s
        return g

    def broadcast(self, t: torch.Tensor) -> None:
        """Broadcast `t` from rank 0 (in place on the other ranks). Raises the op's error, or
        `WeightGroupAborted` soon after the group's `abort` key is set (the group is then
        left: see `abandon`)."""
        with self._lock:
            if self.pg is None and not self.left:
                raise RuntimeError(
                    "no wire in this weight group: every member on it takes buckets through "
                    "shared memory (send_bucket), none receives a broadcast"
                )
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

    def wait_key(self, key: str) -> str:
        """A same-node member: the value of `key` once rank 0 set it, looking at the `abort`
        key meanwhile (polls back off from 0.2 ms to 20 ms: chunk keys come every millisecond
        or two, the first of a push may take the trainer's export). Raises
        `WeightGroupAborted` when the group is aborted or left, RuntimeError after the op
        timeout."""
        deadline, nap = time.monotonic() + self.timeout_s, 0.0002
        while True:
            store = self.store
            if store is None or self.left:
                raise WeightGroupAborted("the weight update group was left during a receive")
            if store.check([key]):  # type: ignore[attr-defined]
                return bytes(store.get(key)).decode()  # type: ignore[attr-defined]
            now = time.monotonic()
            if now >= self._next_look:
                self._next_look = now + ABORT_POLL_S
                why = self.abort_reason()
                if why is not None:
                    self.abandon()
                    raise WeightGroupAborted(f"the weight update group was aborted: {why}")
            if now >= deadline:
                raise RuntimeError(f"rank 0 did not write {key!r} within {self.timeout_s:.0f} s")
            time.sleep(nap)
            nap = min(nap * 2, 0.02)

    def hold(self, sets: Collection[int]) -> None:
        """A same-node member: it now serves tensors viewing these segment sets (of this
        group), which rank 0 must not overwrite."""
        if self.store is not None and self.same_node.reader is not None:
            with contextlib.suppress(RuntimeError):  # rank 0 gone: the group is re-formed
                value = ",".join(str(s) for s in sorted(sets))
                self.store.set(SHM_HOLDS_KEY.format(self.rank), value)  # type: ignore[attr-defined]

    def free_set(self) -> int:
        """Rank 0: a segment set no same-node member holds (the next version goes there)."""
        held = set()
        for r in self.same_node.ranks:
            key = SHM_HOLDS_KEY.format(r)
            if self.store is not None and self.store.check([key]):  # type: ignore[attr-defined]
                value = bytes(self.store.get(key)).decode()  # type: ignore[attr-defined]
                held.update(v for v in value.split(",") if v)
        for s in range(_SHM_SETS):
            if str(s) not in held:
                return s
        raise RuntimeError(f"every segment set is held by a member ({sorted(held)})")

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
            self.left = True
        self.same_node.close()
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
            pg, self.pg, self.store, self.left = self.pg, None, None, True
        self.same_node.close()
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


def tensors_checksum(ts: Sequence[torch.Tensor]) -> list[int]:
    """The digests of the tensors' bytes, one after another (`weight_shm.ChunkHasher`: a flat
    bucket and its pieces agree)."""
    h = shm.ChunkHasher()
    for t in ts:
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            h.update(memoryview(flat.cpu().view(torch.uint8).numpy()))
    return h.finish()


def publish_checksum(g: WeightGroup, digests: list[int]) -> None:
    """Rank 0: the checksum of the bucket it sends next (index `g.buckets`)."""
    if g.store is not None:
        g.store.set(CHECKSUM_KEY.format(g.buckets), shm.format_digests(digests))  # type: ignore[attr-defined]


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


def _bucket_dtype(bucket: Sequence[TensorEntry]) -> torch.dtype:
    dtypes = {e.dtype for e in bucket}
    if len(dtypes) != 1:
        raise ValueError(f"a {FLATTENED} bucket holds one dtype, got {sorted(dtypes)}")
    return torch_dtype(bucket[0].dtype)


def _pieces(
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
    dt = _bucket_dtype(bucket)
    if len(bucket) == 1:
        t = tensors[bucket[0].name].detach()
        if tuple(t.shape) != tuple(bucket[0].shape):
            _pieces(tensors, bucket, torch.empty(t.numel(), dtype=dt))  # raises, naming it
        if t.dtype == dt and t.device == torch.device(device) and t.is_contiguous():
            return t.reshape(-1), tensors_checksum([t])
    nbytes = sum(entry_nbytes(e) for e in bucket)
    raw = bucket_buffer(nbytes, device)
    flat = raw.view(dt)
    pieces = _pieces(tensors, bucket, flat)
    if flat.device.type != "cpu" or nbytes < _CHECKSUM_THREAD_BYTES:
        for dst, src in pieces:
            dst.copy_(src)
        return flat, tensors_checksum([flat])
    return flat, _copy_and_checksum(raw, pieces)


def _copy_and_checksum(
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


def _send_same_node(
    g: WeightGroup,
    tensors: Mapping[str, torch.Tensor],
    bucket: Sequence[TensorEntry],
    slot: tuple[int, int],
) -> None:
    """Rank 0, with members on its node: pack bucket k into segment `slot` (set, bucket of
    the version), its descriptor published first and each chunk's digest as soon as that chunk
    is written; then broadcast it to the wire members, if any."""
    assert g.same_node.pool is not None and g.store is not None
    dt, k = _bucket_dtype(bucket), g.buckets
    nbytes = sum(entry_nbytes(e) for e in bucket)
    seg = g.same_node.pool.segment(*slot, nbytes)
    store = g.store
    store.set(SHM_BUCKET_KEY.format(k), f"{slot[0]},{slot[1]},{seg.fd},{nbytes}")  # type: ignore[attr-defined]

    def chunk_done(c: int, d: int) -> None:
        store.set(CHUNK_KEY.format(k, c), f"{d:016x}")  # type: ignore[attr-defined]

    flat = seg.buffer.view(dt)
    digests = _copy_and_checksum(seg.buffer, _pieces(tensors, bucket, flat), chunk_done)
    publish_checksum(g, digests)
    if g.pg is not None:
        g.broadcast(flat)


def send_bucket(
    g: WeightGroup,
    tensors: Mapping[str, torch.Tensor],
    bucket: Sequence[TensorEntry],
    *,
    flatten: bool,
    slot: tuple[int, int] | None = None,
) -> None:
    """Rank 0: publish the bucket's checksum, then broadcast its tensors (cast to the bucket's
    dtypes): one flat broadcast (`pack_bucket`), or one per tensor in `bucket` order. With
    members on its node the bucket goes through segment `slot` (default: set `free_set()`,
    bucket 0), laid out flat whatever `flatten` says, and the wire members get it flat."""
    if g.same_node.pool is not None:
        _send_same_node(g, tensors, bucket, slot or (g.free_set(), 0))
    elif flatten:
        flat, digests = pack_bucket(tensors, bucket, g.device)
        publish_checksum(g, digests)
        g.broadcast(flat)
    else:
        ts = [tensors[e.name].detach().to(g.device, torch_dtype(e.dtype)) for e in bucket]
        publish_checksum(g, tensors_checksum(ts))
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
    members' receives stop now rather than at the timeout; then it raises. A version's buckets
    go into one segment set that no member holds (members on rank 0's node).

    The tensors handed to the process group may be views of `tensors`: an op abandoned in
    flight only reads them (a member that stopped receiving gets nothing usable)."""
    try:
        set_id = g.free_set() if g.same_node.pool is not None else 0
        for j, b in enumerate(buckets):
            send_bucket(g, tensors, b, flatten=flatten, slot=(set_id, j))
            g.mark_sent()
    except BaseException as e:
        g.abort(f"rank 0 stopped sending: {type(e).__name__}: {e}")
        raise


def receive_bucket(
    g: WeightGroup, bucket: Sequence[TensorEntry], *, flatten: bool
) -> dict[str, torch.Tensor]:
    """Ranks > 0 on the wire: receive the bucket `send_bucket` sends; returns name -> tensor.
    Every member of a gloo group on rank 0's node receives with `receive_checked` instead."""
    if flatten or g.same_node.ranks:  # with members on rank 0's node the wire is flat
        flat = bucket_buffer(sum(entry_nbytes(e) for e in bucket), g.device)
        flat = flat.view(_bucket_dtype(bucket))
        g.broadcast(flat)
        g.buckets += 1
        return _split(flat, bucket)
    out = {}
    for e in bucket:
        t = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device=g.device)
        g.broadcast(t)
        out[e.name] = t
    g.buckets += 1
    return out


def _split(flat: torch.Tensor, bucket: Sequence[TensorEntry]) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for e in bucket:
        n = entry_nbytes(e) // flat.itemsize
        out[e.name] = flat[at : at + n].view(e.shape)
        at += n
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
    """A member's bucket, received and checked (`receive_checked`)."""

    tensors: dict[str, torch.Tensor]
    corrupted: str | None
    """Why its bytes are not what rank 0 sent (None: they are, or nothing was published)."""
    nonfinite: list[str]
    """One sentence per tensor holding NaN or inf (not looked at unless asked)."""
    segment_set: int | None = None
    """The segment set the tensors view (same-node path): read-only, and written again by rank
    0 once this member no longer `hold`s it; None: the tensors are this process's own."""
    segment: str | None = None
    """The segment's name (same-node path)."""
    received_s: float = 0.0
    """Seconds the receive took (the wire; on the same node it overlaps the checks)."""
    checked_s: float = 0.0
    """Seconds the checks took after the receive (the wire)."""


def receive_checked(
    g: WeightGroup, bucket: Sequence[TensorEntry], *, flatten: bool, check_finite: bool
) -> Received:
    """Ranks > 0: receive the bucket (over the wire, or through rank 0's segment on the same
    node), then check its digests against rank 0's and (`check_finite`) every value finite,
    the two checks in two threads (xxhash and torch both release the GIL). On the same node
    each chunk is checked as soon as rank 0 wrote it. Raises what the receive raises."""
    if g.same_node.reader is not None:
        return _receive_same_node(g, bucket, check_finite)
    t0 = time.monotonic()
    got = receive_bucket(g, bucket, flatten=flatten)
    t1 = time.monotonic()
    finite: list[list[str]] = []
    t = threading.Thread(
        target=lambda: finite.append(nonfinite_names(got) if check_finite else []),
        daemon=True,
        name="bucket-finite",
    )
    t.start()
    try:
        corrupted = checksum_problem(g, bucket, got)
    finally:
        t.join()
    nonfinite = finite[0] if finite else ["the finite check failed"]
    return Received(got, corrupted, nonfinite, received_s=t1 - t0, checked_s=time.monotonic() - t1)


def _receive_same_node(
    g: WeightGroup, bucket: Sequence[TensorEntry], check_finite: bool
) -> Received:
    """A member on rank 0's node: map bucket k's segment, check each chunk as its digest
    appears (this thread) and its values finite (a second thread)."""
    reader, k = g.same_node.reader, g.buckets
    assert reader is not None
    set_id, j, fd, nbytes = (int(x) for x in g.wait_key(SHM_BUCKET_KEY.format(k)).split(","))
    if nbytes != sum(entry_nbytes(e) for e in bucket):
        raise ValueError(
            f"rank 0's bucket {k} holds {nbytes} bytes, this call's names and shapes "
            f"{sum(entry_nbytes(e) for e in bucket)}: the sender and the call disagree"
        )
    raw = reader.view(set_id, j, fd, nbytes)
    flat = raw.view(_bucket_dtype(bucket))
    step = shm.CHUNK_BYTES // flat.itemsize
    todo: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    bad_chunks: list[int] = []

    def finite() -> None:
        while (c := todo.get()) is not None:
            if not all_finite(flat[c * step : (c + 1) * step]):
                bad_chunks.append(c)

    worker = threading.Thread(target=finite, daemon=True, name="bucket-finite")
    worker.start()
    corrupted = None
    try:
        for c in range(shm.n_chunks(nbytes)):
            want = int(g.wait_key(CHUNK_KEY.format(k, c)), 16)
            if check_finite:
                todo.put(c)
            have = shm.chunk_digest(raw[c * shm.CHUNK_BYTES : (c + 1) * shm.CHUNK_BYTES])
            if have != want:
                corrupted = (
                    f"bucket {k} is corrupted in shared memory (chunk {c}: xxh3 {have:016x}, "
                    f"rank 0 wrote {want:016x})"
                )
                break
    finally:
        todo.put(None)
        worker.join()
    g.buckets += 1
    got = _split(flat, bucket)
    nonfinite = nonfinite_names(got) if bad_chunks else []
    name = shm.segment_name(reader.offer.nonce, set_id, j)
    return Received(got, corrupted, nonfinite, segment_set=set_id, segment=name)


def nonfinite_names(got: Mapping[str, torch.Tensor]) -> list[str]:
    """The tensors holding NaN or inf, one sentence each (never served, whichever transport
    brought them)."""
    return [
        f"tensor {k!r} holds non-finite values (NaN or inf)"
        for k, t in got.items()
        if not all_finite(t)
    ]


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
        want = shm.parse_digests(bytes(store.get(key)).decode())  # type: ignore[attr-defined]
    except (RuntimeError, ValueError):
        return None  # rank 0's store is gone: the receive itself would have failed
    have = tensors_checksum([got[e.name] for e in bucket])
    if have == want:
        return None
    bad = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
    return (
        f"bucket {g.buckets - 1} arrived corrupted (xxh3 of chunk {bad} differs from what "
        "rank 0 sent)"
    )


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
