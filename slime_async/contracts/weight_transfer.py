"""Moving one bucket of weights through a weight group, both ends, with its checks: rank 0's
`send_bucket` / `send_buckets` and a member's `receive_bucket` / `receive_checked`, over the
wire (gloo or NCCL broadcasts, SGLang's two load formats) or through rank 0's shared-memory
segments when the member is on its node (`weight_group`, "Same node").

Rank 0 publishes the xxh3 digests of each bucket as sent in the group's store before it sends
it (`publish_checksum`); a member compares them with what arrived (`checksum_problem`) and
checks every value finite, in two threads, so a corrupted bucket is never staged. On the same
node each chunk is checked as soon as rank 0 wrote it, while rank 0 writes the next.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from slime_async.contracts import weight_shm as shm
from slime_async.contracts.weight_buckets import (
    bucket_buffer,
    bucket_dtype,
    bucket_pieces,
    copy_and_checksum,
    entry_nbytes,
    nonfinite_names,
    pack_bucket,
    split_flat,
    tensors_checksum,
    torch_dtype,
)
from slime_async.contracts.weight_group import CHECKSUM_KEY, CHUNK_KEY, SHM_BUCKET_KEY, WeightGroup
from slime_async.contracts.weights import TensorEntry, all_finite


def publish_checksum(g: WeightGroup, digests: list[int]) -> None:
    """Rank 0: the checksum of the bucket it sends next (index `g.buckets`)."""
    if g.store is not None:
        g.store.set(CHECKSUM_KEY.format(g.buckets), shm.format_digests(digests))  # type: ignore[attr-defined]


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
    dt, k = bucket_dtype(bucket), g.buckets
    nbytes = sum(entry_nbytes(e) for e in bucket)
    seg = g.same_node.pool.segment(*slot, nbytes)
    store = g.store
    store.set(SHM_BUCKET_KEY.format(k), f"{slot[0]},{slot[1]},{seg.fd},{nbytes}")  # type: ignore[attr-defined]

    def chunk_done(c: int, d: int) -> None:
        store.set(CHUNK_KEY.format(k, c), f"{d:016x}")  # type: ignore[attr-defined]

    flat = seg.buffer.view(dt)
    digests = copy_and_checksum(seg.buffer, bucket_pieces(tensors, bucket, flat), chunk_done)
    publish_checksum(g, digests)
    if g.pg is not None:
        g.broadcast(flat)
    seg.unmap_pages()  # the members' now: none of it in rank 0's memory


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
    go into one segment set that no member holds (members on rank 0's node); the set the
    members served before is released once they all swapped (`WeightGroup.release_idle`).

    The tensors handed to the process group may be views of `tensors`: an op abandoned in
    flight only reads them (a member that stopped receiving gets nothing usable)."""
    try:
        set_id = g.free_set() if g.same_node.pool is not None else 0
        for j, b in enumerate(buckets):
            send_bucket(g, tensors, b, flatten=flatten, slot=(set_id, j))
            g.mark_sent()
        g.release_idle(set_id)
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
        flat = flat.view(bucket_dtype(bucket))
        g.broadcast(flat)
        g.buckets += 1
        return split_flat(flat, bucket)
    out = {}
    for e in bucket:
        t = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device=g.device)
        g.broadcast(t)
        out[e.name] = t
    g.buckets += 1
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
    flat = raw.view(bucket_dtype(bucket))
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
    got = split_flat(flat, bucket)
    nonfinite = nonfinite_names(got) if bad_chunks else []
    name = shm.segment_name(reader.offer.nonce, set_id, j)
    return Received(got, corrupted, nonfinite, segment_set=set_id, segment=name)


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
