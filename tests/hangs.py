"""What the in-process embedded engines hold when a test times out, for the failure report.

pytest-timeout already prints every thread's stack; a hang in an engine test is then named by
what the engine still holds: its state, the model lock, the step loop's task, and each queued,
prefilling or running request with how far it got (`Engine.describe`). `engine_report()` finds
the live engines of this process by walking the garbage collector's objects (only on a
timeout); engines in child processes are not seen here (their logs are).
"""

from __future__ import annotations

import gc
import sys


def engine_report() -> str:
    """One block per live in-process engine; empty when there is none."""
    mod = sys.modules.get("slime_async.engine.engine")
    if mod is None:
        return ""
    blocks = []
    for obj in gc.get_objects():
        if not isinstance(obj, mod.Engine):
            continue
        try:  # read from another thread while the engine runs: best effort
            state = obj.describe()
        except Exception as e:
            state = {"describe failed": repr(e)}
        lines = [f"engine {obj.cfg.host}:{obj.bound_port}"]
        for k, v in state.items():
            if isinstance(v, list):
                lines.append(f"  {k}: {len(v)}")
                lines += [f"    {row}" for row in v]
            else:
                lines.append(f"  {k}: {v}")
        blocks.append("\n".join(lines))
    return "\n".join(blocks)
