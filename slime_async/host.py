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
