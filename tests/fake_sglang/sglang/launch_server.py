"""Stand-in for `python -m sglang.launch_server`: takes SGLang's command line, records what it was
given, and serves our embedded engine (SGLang's HTTP API on CPU) with the same settings. Used by
tests that exercise the real launch code with only the SGLang process replaced.

Environment: FAKE_SGLANG_RECORD (a directory: write `<pid>.json` with argv and /proc cmdline),
FAKE_SGLANG_HANG (never become healthy), FAKE_SGLANG_EXIT (print a message and exit 3).
"""

import json
import os
import sys
import time

args = sys.argv[1:]
record = os.environ.get("FAKE_SGLANG_RECORD")
if record:
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode()
    with open(os.path.join(record, f"{os.getpid()}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "pgid": os.getpgid(0), "argv": args, "cmdline": cmdline}, f)
if os.environ.get("FAKE_SGLANG_EXIT"):
    print("fake sglang: CUDA out of memory (simulated)", flush=True)
    sys.exit(3)
if os.environ.get("FAKE_SGLANG_HANG"):
    time.sleep(3600)

KEEP = (
    "--model-path",
    "--host",
    "--port",
    "--random-seed",
    "--weight-version",
    "--context-length",
    "--max-running-requests",
    "--served-model-name",
)
ours = ["--dtype", "fp32", "--num-threads", "1"]
KEYS = {"--api-key": "SLIME_ASYNC_API_KEY", "--admin-api-key": "SLIME_ASYNC_AUTH_TOKEN"}
for var in KEYS.values():  # SGLang takes its keys from its command line only
    os.environ.pop(var, None)
i = 0
while i < len(args):
    a = args[i]
    value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
    if a in KEEP and value is not None:
        ours += [a, value]
    elif a in KEYS and value is not None:  # ours reads them from the environment
        os.environ[KEYS[a]] = value
    i += 2 if value is not None else 1

from slime_async.engine.__main__ import main  # noqa: E402

main(ours)
