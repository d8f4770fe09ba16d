"""`PYTHON <installed path>/slime_async/engine/sglang_launch.py MODULE ARGS...`: run SGLang's launcher MODULE
with ARGS plus `--api-key <key>` (the data-plane key, from `$SLIME_ASYNC_SGLANG_API_KEY`) and
`--admin-api-key <key>` (from `$SLIME_ASYNC_SGLANG_ADMIN_API_KEY`), each where it is set.

Owns only that hand-over: SGLang takes its keys on the command line, and a command line is
readable by every user of the node (`ps`, /proc/PID/cmdline). The keys are appended to
`sys.argv` inside this process, which /proc does not show. It is run by path with SGLang's interpreter
(`--sglang-python`, which may be a separate virtual environment without this project), so it
imports the standard library only: never sglang at module level, this project, Ray or torch.
"""

from __future__ import annotations

import os
import runpy
import sys

API_KEY_ENV = "SLIME_ASYNC_SGLANG_API_KEY"
"""Environment variable the data-plane key is handed over in."""
ADMIN_KEY_ENV = "SLIME_ASYNC_SGLANG_ADMIN_API_KEY"
"""Environment variable the admin key is handed over in."""


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(f"usage: python {sys.argv[0]} MODULE [SGLANG ARGS...]")
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        # run by path: Python put this directory first, where engine/sglang.py would shadow the
        # `sglang` package; `python -m MODULE` would have the working directory there instead
        sys.path[0] = os.getcwd()
    module, args = sys.argv[1], sys.argv[2:]
    keys: list[str] = []
    for var, flag in ((API_KEY_ENV, "--api-key"), (ADMIN_KEY_ENV, "--admin-api-key")):
        key = os.environ.pop(var, None)
        if key:
            keys += [flag, key]
    if not keys:
        sys.exit(
            f"neither ${API_KEY_ENV} nor ${ADMIN_KEY_ENV} is set: the launcher hands the "
            "server's keys over in them"
        )
    sys.argv = [module, *args, *keys]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
