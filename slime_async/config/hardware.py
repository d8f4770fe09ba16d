"""What this node's hardware offers the run: bf16 matrix units on the CPU, its memory and its GPUs' memory.

Gathers `cpu_bf16_feature` (the `/proc/cpuinfo` flag that makes bf16 matmuls fast on this CPU:
AMX or AVX512_BF16; None without one, where bf16 is emulated and slower than fp32; it lives in
`slime_async.host`, which the engines read it from too), `cpp_compiler` (the C++ compiler the
trainer's fused kernels need; `host` too, where the trainer reads it) and owns
`node_memory_bytes` and `gpu_memory_bytes`. Read once at start-up by `slime_async.config.read_environment`; the
functions taking text are pure. Imports nothing from slime_async but `host`.
"""

from __future__ import annotations

import os

from slime_async.host import BF16_FLAGS, cpp_compiler, cpu_bf16_feature

__all__ = [
    "BF16_FLAGS",
    "cpp_compiler",
    "cpu_bf16_feature",
    "gpu_memory_bytes",
    "node_memory_bytes",
]


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
