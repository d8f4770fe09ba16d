"""The distributed weight transport's process group, both ends: how the trainer's sender (rank
0) and the engines (ranks `rank_offset + i`) form it, find out who shares rank 0's node, and give
it up. What travels through it is `weight_buckets` (the layout) and `weight_transfer` (one bucket,
sent and checked).

Owns `WeightGroup` (one member's handle on a weight-update group: a standalone gloo or NCCL
process group on its own TCP rendezvous, never the default `torch.distributed` group, so a
trainer rank can be in both), the group store's keys, `SameNode` (the same-node handshake's
outcome) and `GroupControl` (the driver's client on the store). Both ends must agree on all of
it, which is why it is a contract. Imports nothing from the rest of slime_async but the
contracts.

Aborting a group. A member that stops receiving (its bucket call failed or was refused before
the receive, or it hangs) would hold every broadcast until the op timeout. The group's own
TCPStore (hosted by rank 0) carries two keys for that: `sent`, the count of buckets rank 0
finished, and `abort`, the reason the group is given up. Every member's `broadcast` polls its op
and the `abort` key; once it is set the member raises `WeightGroupAborted` at once and hands the
process group (with its op still in flight) to a daemon thread that releases it, so no caller
ever blocks in a broadcast or in `close` on a member that stopped. `GroupControl` is the
driver's client on that store: it reads `sent` and sets `abort`.

Same node. On gloo, when the group forms, rank 0 offers shared memory (`shm/offer`: its
`weight_shm.host_identity`, pid, a probe segment, the group's nonce) and every member answers
`shm/member/<rank>`: `shm` when it is on the same node (same identity, the probe segment
readable, not turned off on either side), else `wire`. Only rank 0 and the `wire` members form
the gloo process group (ranks renumbered in the order of their group ranks). Segments come in
sets, one segment per bucket of a version; a member that serves tensors viewing a set says so in
`shm/holds/<rank>` after its swap (`hold`), and rank 0 writes each version into a set no member
holds (`free_set`: two sets alternate), so the bytes a member serves are never written while it
serves them. Once every member swapped away from a set, rank 0 releases its memory until the
next version is written there (`release_idle`), so between pushes the node holds one set of
the model in shared memory, not two. Every failure re-forms the group, and a new group never writes an old group's
segments. How a bucket then goes through a segment: `weight_transfer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import socket
import threading
import time
from collections.abc import Collection

import torch

from slime_async.contracts import weight_shm as shm

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

_SHM_SETS = 3
"""Most segment sets rank 0 keeps (two alternate; a third only if members hold both)."""


class WeightGroupAborted(RuntimeError):
    """The group was given up while this member waited on an op; form a new group."""


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

    def _held(self) -> set[int]:
        """Rank 0: the segment sets some same-node member says it serves from."""
        held: set[int] = set()
        store = self.store
        for r in self.same_node.ranks:
            key = SHM_HOLDS_KEY.format(r)
            if store is not None and store.check([key]):  # type: ignore[attr-defined]
                value = bytes(store.get(key)).decode()  # type: ignore[attr-defined]
                held.update(int(v) for v in value.split(",") if v)
        return held

    def free_set(self) -> int:
        """Rank 0: a segment set no same-node member holds (the next version goes there)."""
        held = self._held()
        for s in range(_SHM_SETS):
            if s not in held:
                return s
        raise RuntimeError(f"every segment set is held by a member ({sorted(held)})")

    def release_idle(self, written: int) -> threading.Thread | None:
        """Rank 0, after a version went into set `written`: in a daemon thread, release
        (`SegmentPool.release`) every other set as soon as no same-node member holds it (each
        member says so after its swap, `hold`), so between pushes only the set being served
        holds memory. Gives up when the next write begins (`SegmentPool.generation`), the
        group is left, or after the op timeout (a member that never swapped keeps its set)."""
        pool = self.same_node.pool
        if pool is None:
            return None
        t = threading.Thread(
            target=self._release_idle,
            args=(pool, written, pool.generation, time.monotonic() + self.timeout_s),
            daemon=True,
            name="weight-group-release-idle",
        )
        t.start()
        return t

    def _release_idle(self, pool: shm.SegmentPool, written: int, gen: int, until: float) -> None:
        nap = 0.002
        while not self.left and time.monotonic() < until:
            with pool.lock:
                if pool.generation != gen or self.left:
                    return
                try:
                    held = self._held()
                except RuntimeError:  # rank 0's own store is closing: the group is going
                    return
                idle = [s for s in pool.sets() if s != written and not pool.released(s)]
                for s in idle:
                    if s not in held:
                        pool.release(s)
                if all(pool.released(s) for s in idle):
                    return
            time.sleep(nap)
            nap = min(nap * 2, 0.05)

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
