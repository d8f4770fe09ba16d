"""CPU core pinning for the processes of a run (the CPU analogue of separate GPU pools).

Owns `pin_cores`: used by the roles (trainer actor) and by engine backends inside the engine's
own process. Imports nothing from slime_async.
"""

from __future__ import annotations

import os


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
