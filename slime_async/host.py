"""Host-level helpers for the processes of a run, shared by roles, trainer and engine backends.

Owns `pin_cores` (CPU core pinning inside a process: the CPU analogue of separate GPU pools) and
`free_port` (a free local TCP port). Imports nothing from slime_async.
"""

from __future__ import annotations

import os
import socket


def pin_cores(cores: tuple[int, ...]) -> None:
    """Restrict every thread of this process (and threads started later) to `cores`, and size
    torch's intra-op pool to match."""
    if not cores:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except (ProcessLookupError, PermissionError):  # thread exited meanwhile
            continue
    import torch

    torch.set_num_threads(len(cores))


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port free on `host` of this node (a rendezvous or server port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
