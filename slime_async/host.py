"""Host-level helpers for the processes of a run, shared by roles, trainer and engine backends.

Owns `pin_cores` (CPU core pinning inside a process: the CPU analogue of separate GPU pools),
`free_port` (a free local TCP port), `trim_heap` (freed memory back to the system) and
`limit_malloc_arenas` (fewer per-thread heaps), `huge_page_malloc` (transparent huge pages
for the heaps of the processes a run starts), `limit_kernel_caches` (bounded caches of
compiled CPU matmuls), `cpp_compiler` (the C++ compiler Inductor would run), `rss_bytes` (this process's resident memory),
`ray_address` (the cluster a run joins: the flag, else
`RAY_ADDRESS`), `cpu_bf16_feature` (the CPU flag that makes bf16 matmuls native here: what
the trainer's `--bf16` and the engine's GEMMs are derived from), and the two file primitives
every durable write uses:
`atomic_write_text` (temp file, fsync, rename) and `file_sha256`. Imports nothing from
slime_async.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path


def pin_cores(cores: tuple[int, ...], threads: int | None = None) -> None:
    """Restrict every thread of this process (and threads started later) to `cores`, and size
    torch's intra-op pool to `threads` (default: one per core)."""
    if not cores:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except (ProcessLookupError, PermissionError):  # thread exited meanwhile
            continue
    import torch

    torch.set_num_threads(threads or len(cores))


def trim_heap() -> bool:
    """Give the heap's free memory back to the system (glibc's `malloc_trim`): a train step's
    freed activations otherwise stay resident in the process until its next step (measured
    +1.6 GiB after a SmolLM2 step; docs/cpu.md#memory). False where the C library is not glibc.
    Fixing glibc's mmap threshold instead (MALLOC_MMAP_THRESHOLD_) also lowers the peak, but
    made the step 1.75x slower here (a page fault per fresh block): not done."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def rss_bytes() -> float:
    """This process's resident memory in bytes (`VmRSS`; 0.0 where /proc has none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """At most `arenas` glibc heaps for this process's threads (`mallopt(M_ARENA_MAX)`; glibc's
    default is 8 per core): each thread otherwise fills a 64 MiB arena of its own that stays
    resident (measured: the driver of the SmolLM2 recipe held 12 full arenas, 0.75 GiB, at
    step 2). Call before the process starts its threads. False where the C library is not
    glibc."""
    libc = _glibc()
    m_arena_max = -8  # glibc's M_ARENA_MAX
    return libc is not None and bool(libc.mallopt(m_arena_max, arenas))


MALLOC_TUNABLES = "glibc.malloc.hugetlb=1"
"""glibc's tunable (2.35+) that has malloc ask the kernel for transparent huge pages
(`madvise(MADV_HUGEPAGE)`) on its heap and its mmapped blocks. A train step allocates its
activations afresh after each step's `trim_heap`: with 4 KiB pages that is one page fault per
4 KiB (over half a million a SmolLM2 step at a 4096-token micro-batch, one to two seconds of
system time), with 2 MiB pages a tenth of the faults (docs/cpu.md#huge-pages). glibc reads it when a
process starts, so it is set in the environment of the processes a run starts, never in a
running one; older glibc and other C libraries ignore it, as does a kernel whose transparent
huge pages are off."""


def huge_page_malloc(env: dict[str, str] | None = None) -> bool:
    """Set `GLIBC_TUNABLES` to `MALLOC_TUNABLES` in `env` (default: this process's environment,
    which the processes it starts inherit) unless it is set already: a value the user gave is
    kept. Returns whether it was set here."""
    env = os.environ if env is None else env
    if "GLIBC_TUNABLES" in env:
        return False
    env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    return True


KERNEL_CACHE_ENTRIES = 64
"""Compiled CPU matmuls each of oneDNN's and ideep's caches keeps (both default to 1024): one
micro-batch's shapes (a layer's GEMMs at one token count, reused by all its layers and by a
recomputed forward) fit, so within a micro-batch every GEMM hits."""
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""oneDNN's primitive cache and ideep's computation cache (torch's CPU bf16 matmuls), each
read once, at the process's first such matmul."""


def limit_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> dict[str, str]:
    """Bound the caches of compiled CPU matmuls this process keeps, keyed by shape, each entry
    with its own buffers: with micro-batches that differ in token count every step adds new
    entries, and by default they stay (docs/cpu.md#memory). A variable the user set is kept. Call
    before the process's first bf16 matmul. Returns the values in force."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(entries))
    return {name: os.environ[name] for name in KERNEL_CACHE_VARIABLES}


def cpp_compiler() -> str | None:
    """The C++ compiler torch's Inductor would run on this node (`CXX`, else g++ or clang++ on
    PATH), or None: without one the trainer's fused CPU kernels cannot be built
    (`trainer.fused`)."""
    import shutil

    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _glibc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both exist: glibc)
    except (OSError, AttributeError):
        return None
    return libc


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port free on `host` of this node (a rendezvous or server port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def gloo_interface(ip: str) -> None:
    """Point gloo at the network interface that holds `ip` (this node's address), unless the
    user set GLOO_SOCKET_IFNAME or `ip` is loopback: by default gloo resolves the host name,
    which on a multi-homed node (or one whose name maps to another address) is not the
    address peers reach."""
    if ip.startswith("127.") or ip == "localhost" or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` so a reader sees the old content or the new, never a part: a
    temp file beside it, flushed to disk, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_sha256(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ray_address(flag: str | None = None) -> str | None:
    """The cluster to join: `--ray-address`, else `RAY_ADDRESS`; None (or "local") starts a
    local one."""
    address = flag or os.environ.get("RAY_ADDRESS") or None
    return None if address == "local" else address


def port_taken(text: str) -> bool:
    """Whether an error's text (or a server's log) says a bind failed because another process
    holds the port (EADDRINUSE): the caller picks another port, unless the user gave it."""
    return "EADDRINUSE" in text or "address already in use" in text.lower()


BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags with native bf16 dot products, best first (oneDNN uses them for bf16 matmuls)."""


def cpu_bf16_feature(cpuinfo: str | None = None) -> str | None:
    """The first of `BF16_FLAGS` the CPU has (from `/proc/cpuinfo`'s text, read if not given),
    or None (no such flag, or no `/proc/cpuinfo`: not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return next((f for f in BF16_FLAGS if f in flags), None)
