"""What this node's hardware offers the run: bf16 matrix units on the CPU, its memory and its GPUs' memory.

Owns `cpu_bf16_feature` (the `/proc/cpuinfo` flag that makes bf16 matmuls fast on this CPU:
AMX or AVX512_BF16; None without one, where bf16 is emulated and slower than fp32) and
`node_memory_bytes` and `gpu_memory_bytes`. Read once at start-up by `slime_async.config.read_environment`; the
functions taking text are pure. Imports nothing from slime_async.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def node_memory_bytes() -> int:
    """Total physical memory of this node (bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_memory_bytes() -> tuple[int, ...]:
    """Total memory of each CUDA device this process sees (empty: none, or no CUDA build)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return tuple(
        torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
    )
