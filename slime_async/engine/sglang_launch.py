"""`python -m slime_async.engine.sglang_launch MODULE ARGS...`: run SGLang's launcher MODULE with
ARGS plus `--api-key <token>`, the token read from `$SLIME_ASYNC_SGLANG_API_KEY`.

Owns only that hand-over: SGLang takes its key on the command line, and a command line is
readable by every user of the node (`ps`, /proc/PID/cmdline). The key is appended to `sys.argv`
inside this process, which /proc does not show. Must never import sglang at module level, Ray or
torch.
"""

from __future__ import annotations

import os
import runpy
import sys

from slime_async.engine.sglang import API_KEY_ENV


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m slime_async.engine.sglang_launch MODULE [SGLANG ARGS...]")
    module, args = sys.argv[1], sys.argv[2:]
    key = os.environ.pop(API_KEY_ENV, None)
    if not key:
        sys.exit(f"${API_KEY_ENV} is not set: the launcher hands the server's token over in it")
    sys.argv = [module, *args, "--api-key", key]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
