"""The same-node path of the weight group: buckets in shared memory for the members on trainer
rank 0's host, and the bucket checksum every path uses.

Owns `host_identity` (what "the same node" means: one kernel boot and one pid namespace),
`Offer` (what rank 0 hands the members when the group forms), `SegmentPool` (rank 0's
shared-memory segments) and `SegmentReader` (a member's read-only mappings of them), and the
checksum (`ChunkHasher`, `format_digests`, `parse_digests`: xxh3_64 of every `CHUNK_BYTES` of a
bucket, ~5x zlib's CRC-32 here, so it overlaps the copy instead of outlasting it;
docs/results/2026-11-27-weight-sync-floor.md). `contracts.weight_group` runs the protocol;
this module holds its pieces. Linux only (memfd and /proc); elsewhere `SegmentPool` refuses and
every member takes the wire.

A segment is an anonymous shared-memory file (`memfd_create`), never a name in /dev/shm: it lives
while rank 0 holds it or a member maps it, so nothing is left behind when either side dies. Its
name is `slime-wg-<nonce>-s<set>-b<bucket>`, the nonce random per group; a member reaches it
through rank 0's open descriptor (`/proc/<pid>/fd/<n>`) and maps it only after checking that the
file behind the descriptor is a memfd of exactly that name, of the bucket's size, sealed against
shrinking and growing (so a mapping can never fault past its end). A segment's descriptor and
mappings are kept for the group's life, but a set no member serves from holds no memory between
pushes: rank 0 punches its pages out (`SegmentPool.release`, `MADV_REMOVE`: the file keeps its
size and seals, every mapping of it reads zeros) and populates them again in one call before
the next version is written there (`MADV_POPULATE_WRITE`, ~2x faster than faulting them in on
the copy). Once a bucket is written and sent, rank 0 drops its pages from its own page tables
(`Segment.unmap_pages`): the members that map the segment keep them. Which set a member
still serves from is what rank 0 must neither overwrite nor release (`contracts.weight_group`,
"Same node").

Worked example (CHUNK_BYTES = 16 MiB): a 40 MiB bucket has three digests, of bytes [0, 16),
[16, 32) and [32, 40) MiB; `format_digests` writes them as three 16-digit hex numbers joined by
commas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import re
import secrets
import stat
import sys
import threading
import warnings
from collections.abc import Callable

import torch
import xxhash

CHUNK_BYTES = 16 << 20
"""Bytes per checksum digest: a member on the same node checks chunk c as soon as rank 0
published its digest, while rank 0 still writes the next ones."""
NAME_PREFIX = "slime-wg-"
_NAME = re.compile(r"^slime-wg-(?P<nonce>[0-9a-f]{16})-s(?P<set>\d{1,3})-b(?P<j>\d{1,6})$")
_SEALS = ("F_SEAL_SHRINK", "F_SEAL_GROW")
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux >= 5.14: fault a range in writable in one call (older kernels: EINVAL, then the
copy faults the pages in itself)."""


def host_identity() -> str:
    """This process's node as the same-node path means it: the kernel's boot id and the pid
    namespace (a member must reach rank 0's descriptors through /proc). Two processes with the
    same identity share memory; any difference sends the member's buckets over the wire."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"no-proc:{os.uname().nodename}:{os.getpid()}"  # never the same as another's
    return f"{boot}/pidns:{ns}"


def supported() -> bool:
    """Whether this platform has what segments need (Linux: memfd, seals, /proc)."""
    import fcntl

    return (
        sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
        and all(hasattr(fcntl, s) for s in _SEALS)
        and os.path.isdir("/proc/self/fd")
    )


def segment_name(nonce: str, set_id: int, j: int) -> str:
    return f"{NAME_PREFIX}{nonce}-s{set_id}-b{j}"


def parse_segment_name(name: object) -> tuple[str, int, int]:
    """(nonce, set, bucket) of a segment name; ValueError names what is wrong with anything
    else (a path, another prefix, a name too long)."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(
            f"{name!r} is not a weight-group segment name (slime-wg-<16 hex>-s<set>-b<bucket>); "
            "segments are anonymous shared memory a weight group creates, never a path"
        )
    return m["nonce"], int(m["set"]), int(m["j"])


# ---------------------------------------------------------------------------- checksum
class ChunkHasher:
    """xxh3_64 of every `CHUNK_BYTES` of a byte stream fed in pieces of any size: the digests
    of a flat bucket and of its tensors one after another agree."""

    def __init__(self, on_chunk: Callable[[int, int], None] | None = None) -> None:
        self.digests: list[int] = []
        self._h = xxhash.xxh3_64()
        self._filled = 0
        self._on_chunk = on_chunk
        """Called with (chunk index, digest) as each chunk completes."""

    def update(self, data: memoryview) -> None:
        data = data.cast("B")
        while len(data):
            take = min(len(data), CHUNK_BYTES - self._filled)
            self._h.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == CHUNK_BYTES:
                self._emit()

    def _emit(self) -> None:
        d = self._h.intdigest()
        self.digests.append(d)
        if self._on_chunk is not None:
            self._on_chunk(len(self.digests) - 1, d)
        self._h.reset()
        self._filled = 0

    def finish(self) -> list[int]:
        if self._filled:
            self._emit()
        return self.digests


def chunk_digest(chunk: torch.Tensor) -> int:
    """xxh3_64 of one chunk's bytes (a contiguous CPU tensor)."""
    return xxhash.xxh3_64_intdigest(memoryview(chunk.reshape(-1).view(torch.uint8).numpy()))


def format_digests(digests: list[int]) -> str:
    return ",".join(f"{d:016x}" for d in digests)


def parse_digests(text: str) -> list[int]:
    return [int(x, 16) for x in text.split(",")] if text else []


def n_chunks(nbytes: int) -> int:
    return -(-nbytes // CHUNK_BYTES)


# ---------------------------------------------------------------------------- the offer
@dataclasses.dataclass(frozen=True, slots=True)
class Offer:
    """What rank 0 offers when the group forms (the store's `shm/offer`): its host identity,
    its pid, a probe segment's descriptor and the group's nonce."""

    host: str
    pid: int
    probe_fd: int
    nonce: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Offer | None:
        """None for rank 0's "no offer" (an empty value)."""
        if not text:
            return None
        d = json.loads(text)
        return cls(host=str(d["host"]), pid=int(d["pid"]), probe_fd=int(d["probe_fd"]),
                   nonce=str(d["nonce"]))  # fmt: skip


def _memfd(name: str, nbytes: int) -> int:
    import fcntl

    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except OSError:
        os.close(fd)
        raise
    return fd


def _as_tensor(m: mmap.mmap, nbytes: int) -> torch.Tensor:
    with warnings.catch_warnings():  # a member's mapping is read-only on purpose
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(m, dtype=torch.uint8)[:nbytes]


@dataclasses.dataclass(slots=True)
class Segment:
    """One shared-memory file and rank 0's writable mapping of it."""

    fd: int
    nbytes: int
    buffer: torch.Tensor
    """uint8 view of the whole mapping (`nbytes`)."""
    mapping: mmap.mmap | None = None
    """The writable shared mapping `buffer` views (None once dropped)."""
    released: bool = False
    """Its pages were punched out (`SegmentPool.release`): no memory until written again."""

    def unmap_pages(self) -> None:
        """Rank 0 has written and sent this segment: drop its pages from rank 0's page tables
        (`MADV_DONTNEED`, which on a shared mapping discards nothing: the file keeps them, and
        the members that map it still read them). Rank 0 then holds none of a version's bytes
        in its own memory between pushes; `SegmentPool.segment` maps them in again before a
        write."""
        if self.mapping is not None:
            with contextlib.suppress(OSError, ValueError):
                self.mapping.madvise(mmap.MADV_DONTNEED)


def _populate(m: mmap.mmap) -> None:
    """Fault every page of a shared mapping in, writable, in one call (best effort)."""
    with contextlib.suppress(OSError, ValueError):
        m.madvise(MADV_POPULATE_WRITE)


class SegmentPool:
    """Rank 0's segments: one per (set, bucket of the version), created on first use and kept
    for the group's life (a set is written again only once no member serves from it). A set
    nobody serves from is `release`d: its pages go back to the kernel until it is written
    again. `lock` orders a release against a write: every `segment` call counts in
    `generation`, so a release decided before a write began is not carried out after it."""

    def __init__(self) -> None:
        if not supported():
            raise OSError("no memfd/seals//proc here: the same-node path needs Linux")
        self.nonce = secrets.token_hex(8)
        self.probe_fd = _memfd(f"{NAME_PREFIX}{self.nonce}-probe", len(self.nonce))
        os.pwrite(self.probe_fd, self.nonce.encode(), 0)
        self.segments: dict[tuple[int, int], Segment] = {}
        self.lock = threading.Lock()
        self.generation = 0
        """How many `segment` calls there were (a release checks it did not change)."""

    def offer(self, host: str) -> Offer:
        return Offer(host=host, pid=os.getpid(), probe_fd=self.probe_fd, nonce=self.nonce)

    def segment(self, set_id: int, j: int, nbytes: int) -> Segment:
        """The segment of (set, bucket j), `nbytes` long (re-created if the size changed),
        its pages populated, to be written now."""
        with self.lock:
            self.generation += 1
            seg = self.segments.get((set_id, j))
            if seg is not None and seg.nbytes == nbytes:
                if seg.mapping is not None:  # pages back in (after `Segment.unmap_pages`)
                    _populate(seg.mapping)
                    seg.released = False
                return seg
            if seg is not None:
                self._drop(seg)
            fd = _memfd(segment_name(self.nonce, set_id, j), nbytes)
            m = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # effective where shmem THP is `advise`
                with contextlib.suppress(OSError):
                    m.madvise(mmap.MADV_HUGEPAGE)
            _populate(m)
            seg = Segment(fd=fd, nbytes=nbytes, buffer=_as_tensor(m, nbytes), mapping=m)
            self.segments[(set_id, j)] = seg
            return seg

    def sets(self) -> set[int]:
        """The sets that have segments."""
        return {s for s, _ in self.segments}

    def release(self, set_id: int) -> int:
        """Punch out the pages of every segment of `set_id` (the caller holds `lock` and knows
        no member serves from the set): the memory goes back to the kernel, from every process
        that maps it; size, seals and descriptors stay. Returns the bytes released."""
        freed = 0
        for (s, _), seg in self.segments.items():
            if s != set_id or seg.released or seg.mapping is None:
                continue
            try:
                seg.mapping.madvise(mmap.MADV_REMOVE)
            except (OSError, ValueError):
                continue  # kept: the next write reuses it as before
            seg.released = True
            freed += seg.nbytes
        return freed

    def released(self, set_id: int) -> bool:
        """Whether every segment of `set_id` holds no memory (True for a set with none)."""
        return all(seg.released for (s, _), seg in self.segments.items() if s == set_id)

    @staticmethod
    def _drop(seg: Segment) -> None:
        with contextlib.suppress(OSError):
            os.close(seg.fd)
        seg.buffer = torch.empty(0, dtype=torch.uint8)  # the mapping goes with its last view
        seg.mapping = None

    def close(self) -> None:
        """Give every segment up: what a member still maps stays alive for it alone."""
        with self.lock:
            for seg in self.segments.values():
                self._drop(seg)
            self.segments.clear()
        if self.probe_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.probe_fd)
            self.probe_fd = -1


class SegmentReader:
    """A member's read-only mappings of rank 0's segments, cached per (set, bucket)."""

    def __init__(self, offer: Offer) -> None:
        self.offer = offer
        self._maps: dict[tuple[int, int], tuple[int, int, torch.Tensor]] = {}

    def _open(self, fd: int, name: str, nbytes: int) -> int:
        """Open rank 0's descriptor `fd` read-only, checked to be the memfd `name` of `nbytes`
        sealed against resizing; OSError/ValueError otherwise."""
        import fcntl

        mine = os.open(f"/proc/{self.offer.pid}/fd/{int(fd)}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = os.readlink(f"/proc/self/fd/{mine}")
            st = os.fstat(mine)
            seals = fcntl.fcntl(mine, fcntl.F_GET_SEALS)
            want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            if target != f"/memfd:{name} (deleted)" or not stat.S_ISREG(st.st_mode):
                raise ValueError(f"rank 0's descriptor {fd} is {target!r}, not segment {name!r}")
            if st.st_size != max(nbytes, 1) or seals & want != want:
                raise ValueError(
                    f"segment {name!r} is {st.st_size} bytes with seals {seals:#x}; the bucket "
                    f"needs {nbytes} bytes sealed against resizing"
                )
        except BaseException:
            os.close(mine)
            raise
        return mine

    def probe(self) -> str | None:
        """Why rank 0's segments cannot be read from here (None: they can)."""
        try:
            fd = self._open(self.offer.probe_fd, f"{NAME_PREFIX}{self.offer.nonce}-probe",
                            len(self.offer.nonce))  # fmt: skip
        except (OSError, ValueError) as e:
            return f"rank 0's probe segment is not readable here ({e})"
        try:
            got = os.pread(fd, len(self.offer.nonce), 0).decode(errors="replace")
        finally:
            os.close(fd)
        return None if got == self.offer.nonce else "rank 0's probe segment holds another nonce"

    def view(self, set_id: int, j: int, fd: int, nbytes: int) -> torch.Tensor:
        """uint8 view of segment (set, j) at rank 0's descriptor `fd` (mapped once, read-only:
        nothing in this process can write the bytes it serves)."""
        hit = self._maps.get((set_id, j))
        if hit is not None and hit[:2] == (fd, nbytes):
            return hit[2]
        mine = self._open(fd, segment_name(self.offer.nonce, set_id, j), nbytes)
        try:
            m = mmap.mmap(mine, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(mine)
        t = _as_tensor(m, nbytes)
        self._maps[(set_id, j)] = (fd, nbytes, t)
        return t

    def close(self) -> None:
        """Forget the mappings (a mapping some served tensor still views stays until it goes)."""
        self._maps.clear()
