"""`python -m router ...`: run the router service until SIGINT/SIGTERM.

Owns: the command-line entry point only. Must never import: `slime_async`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from clifields import HelpFormatter
from router.config import add_router_args, router_config_from_args
from router.server import Router, warn_if_exposed


async def _run(router: Router) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = await router.start()
    print(f"router listening on {url} (policy {router.cfg.policy})", flush=True)
    try:
        await stop.wait()
    finally:
        await router.stop()


def main(argv: list[str] | None = None) -> int:
    """Parse flags (`--router-*`, or the short `--host/--port/--worker-urls/--policy`) and serve."""
    parser = argparse.ArgumentParser(
        prog="python -m router",
        description="Work-aware, fault-tolerant router for SGLang engines.",
        formatter_class=HelpFormatter,
    )
    add_router_args(parser, prefix="")
    args = parser.parse_args(argv)
    if args.auth_token:
        print(
            "warning: --auth-token is visible to every user of this machine (ps, /proc); "
            "use $SLIME_ASYNC_AUTH_TOKEN or --auth-token-file instead",
            file=sys.stderr,
            flush=True,
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = router_config_from_args(args, prefix="")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    note = warn_if_exposed(cfg)  # who may call what without a key is logged once it listens
    if note:
        print(note, flush=True)
    asyncio.run(_run(Router(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
