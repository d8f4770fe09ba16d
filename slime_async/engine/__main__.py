"""`python -m slime_async.engine`: serve one embedded engine until SIGTERM/SIGINT, then exit
at once (status 0) without the interpreter's slow teardown.

Owns: the shell entry point only (flags come from `config.add_engine_args`).
Must never import Ray or the trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from slime_async.engine.config import add_engine_args, engine_config_from_args
from slime_async.engine.engine import Engine
from slime_async.engine.runner import serve, write_port_file
from slime_async.host import limit_kernel_caches, limit_malloc_arenas


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m slime_async.engine",
        description="Embedded inference engine speaking SGLang's HTTP API (CPU or any device).",
    )
    limit_malloc_arenas()  # before any thread starts: the server's and torch's share two heaps
    limit_kernel_caches()
    args = add_engine_args(parser).parse_args(argv)
    try:
        cfg = engine_config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def ready(_engine: Engine, port: int) -> None:
            logging.info("serving on http://%s:%d", cfg.host, port)
            if args.port_file:
                write_port_file(args.port_file, port)

        await serve(cfg, stop, on_ready=ready)

    asyncio.run(run())
    # Stopped and flushed: exit now. The interpreter's own teardown of a process that loaded
    # torch and a model takes seconds (measured: docs/results/2026-11-27-test-suite.md), and
    # every caller that stops an engine (a test, a supervisor replacing one) waits it out.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
